"""The recurrent ops (``rnn_tanh``, ``rnn_relu``, ``gru``, ``lstm``, ``.input`` and ``.data``) under torch.func.

The references never run under a transform: PyTorch's own aten op called outside any transform, once per sample
(values with ``torch.autograd`` for gradients). Inside ``use()`` vmap, vmap(grad), jacrev and jacfwd must equal them
with no fallback to vmap's per-sample loop; outside ``use()`` the tests pin down what PyTorch 2.13 itself does, so the
rules that route around it stay honest.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.func import grad, jacfwd, jacrev, vmap
from torch.nn.utils.rnn import pack_padded_sequence

import registry
from composites import recurrent
from registry.harness import fallback

aten = torch.ops.aten
SAMPLES, T, N, FEATURES, H = 3, 4, 2, 3, 5
FALLBACK = "There is a performance drop"


@dataclass(frozen=True)
class Config:
    op: str
    num_layers: int = 1
    bidirectional: bool = False
    batch_first: bool = False
    bias: bool = True
    proj_size: int = 0

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def out_size(self) -> int:
        return self.proj_size or H

    def __str__(self) -> str:
        flags = [f"L{self.num_layers}", "bi" if self.bidirectional else "", "bf" if self.batch_first else "",
                 "" if self.bias else "nobias", f"proj{self.proj_size}" if self.proj_size else ""]
        return "-".join([self.op, *[f for f in flags if f]])


CONFIGS = [
    *(Config(op) for op in ("rnn_tanh", "rnn_relu", "gru", "lstm")),
    *(Config(op, num_layers=2, bidirectional=True, batch_first=True) for op in ("rnn_tanh", "rnn_relu", "gru",
                                                                                 "lstm")),
    Config("gru", num_layers=3, bias=False),
    Config("lstm", num_layers=2, bidirectional=True, proj_size=2),
    Config("lstm", bias=False, batch_first=True),
]


def _params(config: Config, generator: torch.Generator, batch: int | None = None) -> list[torch.Tensor]:
    """The flat parameter list PyTorch's modules pass (``_flat_weights``), random, optionally one set per sample."""
    gates = {"rnn_tanh": 1, "rnn_relu": 1, "gru": 3, "lstm": 4}[config.op]
    lead = () if batch is None else (batch,)
    found = []
    for layer in range(config.num_layers):
        for _ in range(config.directions):
            in_size = FEATURES if layer == 0 else config.out_size * config.directions
            shapes = [(gates * H, in_size), (gates * H, config.out_size)]
            if config.bias:
                shapes += [(gates * H,), (gates * H,)]
            if config.proj_size:
                shapes.append((config.proj_size, H))
            found += [torch.randn(*lead, *shape, generator=generator, dtype=torch.float64) * 0.5 for shape in shapes]
    return found


def _input(config: Config, generator: torch.Generator, batch: int | None = SAMPLES) -> torch.Tensor:
    shape = (N, T, FEATURES) if config.batch_first else (T, N, FEATURES)
    lead = () if batch is None else (batch,)
    return torch.randn(*lead, *shape, generator=generator, dtype=torch.float64)


def _hx(config: Config, generator: torch.Generator, zero: bool = False):
    h_shape = (config.num_layers * config.directions, N, config.out_size)
    make = (lambda shape: torch.zeros(shape, dtype=torch.float64)) if zero else (
        lambda shape: torch.randn(shape, generator=generator, dtype=torch.float64))
    if config.op == "lstm":
        return [make(h_shape), make((config.num_layers * config.directions, N, H))]
    return make(h_shape)


def _call(config: Config, x: torch.Tensor, hx, params: list[torch.Tensor], dropout: float = 0.0,
          train: bool = False) -> tuple[torch.Tensor, ...]:
    """PyTorch's own aten op (routed when called under a transform inside use())."""
    packet = getattr(aten, config.op)
    return packet.input(x, hx, params, config.bias, config.num_layers, dropout, train, config.bidirectional,
                        config.batch_first)


def _loss(outputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    weights = [torch.linspace(-1.0, 1.5, o.numel(), dtype=o.dtype).reshape(o.shape) for o in outputs]
    return sum(((o * w).sin()).sum() for o, w in zip(outputs, weights, strict=True))


def _no_fallback(run: Callable[[], object]) -> object:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch._C._functorch._set_vmap_fallback_warning_enabled(True)
        try:
            result = run()
        finally:
            torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    fallbacks = [str(w.message) for w in caught if FALLBACK in str(w.message)]
    assert fallbacks == []
    return result


# --- the composite itself equals PyTorch's op outside any transform ------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("zero_state", [False, True], ids=["given-state", "zero-state"])
def test_unrolled_equals_native_values_and_gradients(config: Config, zero_state: bool) -> None:
    _equals_native("unrolled", config, zero_state)


RECURRENCE_CONFIGS = [c for c in CONFIGS if c.op in ("lstm", "gru")]


@pytest.mark.parametrize("config", RECURRENCE_CONFIGS, ids=str)
@pytest.mark.parametrize("zero_state", [False, True], ids=["given-state", "zero-state"])
def test_recurrence_equals_native_values_and_gradients(config: Config, zero_state: bool) -> None:
    """The recurrence primitive outside any transform: its forward and its own backward (BPTT) against PyTorch's."""
    _equals_native("recurrence", config, zero_state)


def _equals_native(name: str, config: Config, zero_state: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    params = [p.requires_grad_() for p in _params(config, generator)]
    x = _input(config, generator, batch=None).requires_grad_()
    hx = _hx(config, generator, zero=zero_state)
    hx_leaves = hx if isinstance(hx, list) else [hx]
    for h in hx_leaves:
        h.requires_grad_()
    composite = registry.COMPOSITES[config.op][name].fn
    expected = _call(config, x, hx, params)
    got = composite(x, hx, params, config.bias, config.num_layers, 0.0, False, config.bidirectional,
                    config.batch_first)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    inputs = [x, *hx_leaves, *params]
    expected_grads = torch.autograd.grad(_loss(expected), inputs)
    got_grads = torch.autograd.grad(_loss(got), inputs)
    for g, e in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)


# --- under transforms, inside use(), against a per-sample loop of PyTorch's op -------------------------------------


def _per_sample(config: Config, x: torch.Tensor, hx, params: list[torch.Tensor], batched_params: bool):
    """(outputs, gradients of the loss in every parameter) per sample, PyTorch's op outside any transform."""
    outputs, grads = [], []
    for b in range(x.shape[0]):
        sample_params = [(p[b] if batched_params else p).detach().clone().requires_grad_() for p in params]
        result = _call(config, x[b], hx, sample_params)
        outputs.append(tuple(o.detach() for o in result))
        grads.append(torch.autograd.grad(_loss(result), sample_params))
    stack = lambda items: [torch.stack(column) for column in zip(*items, strict=True)]  # noqa: E731
    return stack(outputs), stack(grads)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_vmap_inside_use_equals_the_loop(config: Config) -> None:
    generator = torch.Generator().manual_seed(1)
    params, x, hx = _params(config, generator), _input(config, generator), _hx(config, generator)
    expected, _ = _per_sample(config, x, hx, params, batched_params=False)
    with registry.use():
        got = _no_fallback(lambda: vmap(lambda sample: _call(config, sample, hx, params))(x))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_per_sample_gradients_inside_use_equal_the_loop(config: Config) -> None:
    generator = torch.Generator().manual_seed(2)
    params, x, hx = _params(config, generator), _input(config, generator), _hx(config, generator)
    _, expected = _per_sample(config, x, hx, params, batched_params=False)

    def loss(weights: list[torch.Tensor], sample: torch.Tensor) -> torch.Tensor:
        return _loss(_call(config, sample, hx, weights))

    with registry.use():
        got = _no_fallback(lambda: vmap(grad(loss), in_dims=(None, 0))(params, x))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("config", RECURRENCE_CONFIGS, ids=str)
@pytest.mark.parametrize("stack", ["vmap(grad)", "vmap(jacrev)"])
def test_recurrence_per_sample_gradients_equal_the_loop(config: Config, stack: str) -> None:
    """Pinned, so that the primitive runs (where a layer has a projection its recurrence stays unrolled)."""
    generator = torch.Generator().manual_seed(5)
    params, x, hx = _params(config, generator), _input(config, generator), _hx(config, generator)
    _, expected = _per_sample(config, x, hx, params, batched_params=False)

    def loss(weights: list[torch.Tensor], sample: torch.Tensor) -> torch.Tensor:
        return _loss(_call(config, sample, hx, weights))

    transform = grad if stack == "vmap(grad)" else jacrev
    with registry.use(pins={config.op: "recurrence"}):
        got = _no_fallback(lambda: vmap(transform(loss), in_dims=(None, 0))(params, x))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("config", [CONFIGS[2], CONFIGS[3], CONFIGS[7]], ids=str)
def test_ensemble_of_weights_and_states_inside_use_equals_the_loop(config: Config) -> None:
    """Parameters and initial state batched too (an ensemble, one model per sample)."""
    generator = torch.Generator().manual_seed(3)
    params, x = _params(config, generator, batch=SAMPLES), _input(config, generator)
    states = [_hx(config, generator) for _ in range(SAMPLES)]
    hx = [torch.stack([s[k] for s in states]) for k in range(2)] if config.op == "lstm" else torch.stack(states)
    expected_out, expected_grads = [], []
    for b in range(SAMPLES):
        sample_params = [p[b].clone().requires_grad_() for p in params]
        result = _call(config, x[b], [h[b] for h in hx] if config.op == "lstm" else hx[b], sample_params)
        expected_out.append(result[0].detach())
        expected_grads.append(torch.autograd.grad(_loss(result), sample_params))

    def loss(weights: list[torch.Tensor], sample: torch.Tensor, state) -> torch.Tensor:
        return _loss(_call(config, sample, state, weights))

    with registry.use():
        out = _no_fallback(lambda: vmap(lambda w, s, h: _call(config, s, h, w)[0])(params, x, hx))
        grads = _no_fallback(lambda: vmap(grad(loss))(params, x, hx))
    torch.testing.assert_close(out, torch.stack(expected_out))
    for g, e in zip(grads, zip(*expected_grads, strict=True), strict=True):
        torch.testing.assert_close(g, torch.stack(e))


@pytest.mark.parametrize("config", [CONFIGS[2], CONFIGS[3], CONFIGS[6], CONFIGS[9]], ids=str)
@pytest.mark.parametrize("transform", ["jacrev", "jacfwd"])
def test_jacobians_inside_use_equal_autograd(config: Config, transform: str) -> None:
    """The Jacobian of the output in the input, row by row from torch.autograd outside any transform."""
    generator = torch.Generator().manual_seed(4)
    params, hx = _params(config, generator), _hx(config, generator)
    x = _input(config, generator, batch=None)

    def output(sample: torch.Tensor) -> torch.Tensor:
        return _call(config, sample, hx, params)[0]

    leaf = x.clone().requires_grad_()
    out = output(leaf)
    rows = [torch.autograd.grad(out.reshape(-1)[k], leaf, retain_graph=True)[0] for k in range(out.numel())]
    expected = torch.stack(rows).reshape(*out.shape, *x.shape)
    with registry.use():
        got = _no_fallback(lambda: (jacrev if transform == "jacrev" else jacfwd)(output)(x))
    torch.testing.assert_close(got, expected)


# --- what PyTorch itself does, which the rules route around --------------------------------------------------------


@pytest.mark.parametrize("op", ["rnn_tanh", "rnn_relu", "gru", "lstm"])
def test_pytorch_raises_under_vmap_outside_use(op: str) -> None:
    config = Config(op)
    generator = torch.Generator().manual_seed(5)
    params, x, hx = _params(config, generator), _input(config, generator), _hx(config, generator)
    with pytest.raises(RuntimeError, match=f"Batching rule not implemented for aten::{op}.input"):
        vmap(lambda sample: _call(config, sample, hx, params))(x)


@pytest.mark.parametrize("op", ["rnn_tanh", "gru", "lstm"])
def test_pytorch_under_vmap_grad_outside_use(op: str) -> None:
    """The aten ops raise a shape error inside their own decomposition."""
    config = Config(op)
    generator = torch.Generator().manual_seed(6)
    params, x, hx = _params(config, generator), _input(config, generator), _hx(config, generator)
    loss = lambda weights, sample: _loss(_call(config, sample, hx, weights))  # noqa: E731
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        vmap(grad(loss), in_dims=(None, 0))(params, x)


def test_pytorch_lstm_module_loops_under_vmap_grad_outside_use() -> None:
    """nn.LSTM with its zero initial state takes the mkldnn path on CPU: vmap's per-sample loop."""
    module = nn.LSTM(FEATURES, H)
    params = {name: p.detach() for name, p in module.named_parameters()}
    loss = lambda weights, sample: torch.func.functional_call(module, weights, (sample,))[0].sum()  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch._C._functorch._set_vmap_fallback_warning_enabled(True)
        try:
            vmap(grad(loss), in_dims=(None, 0))(params, torch.randn(SAMPLES, T, FEATURES))
        finally:
            torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    assert any("aten::mkldnn_rnn_layer" in str(w.message) for w in caught)


def test_auto_keeps_native_where_it_works_and_routes_where_it_fails() -> None:
    for op in ("rnn_tanh", "rnn_relu", "gru", "lstm"):
        assert registry.select(op, stack="grad", policy="rules").kind == "native"
        assert registry.select(op, stack="jacrev", policy="rules").kind == "native"
        for stack in ("vmap", "vmap,grad", "vmap,jvp", "jacfwd"):
            decision = registry.select(op, stack=stack, batched=["input"], policy="rules")
            expected = (("recurrence", "primitive") if op in ("lstm", "gru") and stack == "vmap,grad"
                        else ("unrolled", "functional"))
            assert (decision.composite, decision.kind) == expected, (op, stack)
        # Under vmap alone every batching raises (the parameters batched too, which the router cannot see).
        assert registry.select(op, stack="vmap", policy="rules").composite == "unrolled"
    for op in ("rnn_tanh", "rnn_relu", "gru"):
        # jacfwd (nothing the op sees is batched) and ensembles under vmap(grad) work natively.
        assert registry.select(op, stack="jacfwd", policy="rules").kind == "native"
        assert registry.select(op, stack="vmap,grad", policy="rules").kind == "native"
        routed = "recurrence" if op == "gru" else "unrolled"
        assert registry.select(op, stack="vmap,grad", batched=["hx"], policy="rules").composite == routed
    # The LSTM's state is a Tensor[] the router cannot see, and its forward AD is missing: every vmap routes.
    assert registry.select("lstm", stack="jacfwd", policy="rules").composite == "unrolled"
    # Under vmap(grad) the recurrence primitive (one product per sample for the hidden weight's gradient); where
    # it has no derivative (forward AD, second derivatives) the unrolled cells.
    assert registry.select("lstm", stack="vmap,grad", policy="rules").composite == "recurrence"
    for stack in ("hessian", "vmap,grad,grad", "vmap,jvp,grad"):
        assert registry.select("lstm", stack=stack, policy="rules").composite == "unrolled", stack


@pytest.mark.parametrize("op", ["rnn_tanh", "gru", "lstm"])
def test_pytorch_where_the_rules_keep_it(op: str) -> None:
    """Natively: jacfwd works for the RNN and the GRU (not the float32 LSTM: no forward AD for mkldnn_rnn_layer), and
    per-model gradients of an ensemble over a shared input work for all three; inside use() too, and the ensemble's
    forward alone (which natively raises) equals the loop."""
    config = Config(op)
    generator = torch.Generator().manual_seed(17)
    params, hx = _params(config, generator, batch=SAMPLES), _hx(config, generator)
    x = _input(config, generator, batch=None)
    per_model = grad(lambda weights: _loss(_call(config, x, hx, weights)))
    ensemble = vmap(per_model)(params)
    with registry.use():  # the same inside use(): native for the RNN and GRU, the composite for the LSTM
        routed = _no_fallback(lambda: vmap(per_model)(params))
        forward = _no_fallback(lambda: vmap(lambda weights: _call(config, x, hx, weights)[0])(params))
    for b in range(SAMPLES):
        leaves = [p[b].clone().requires_grad_() for p in params]
        result = _call(config, x, hx, leaves)
        torch.testing.assert_close(forward[b], result[0].detach())
        for g, r, e in zip(ensemble, routed, torch.autograd.grad(_loss(result), leaves), strict=True):
            torch.testing.assert_close(g[b], e)
            torch.testing.assert_close(r[b], e)
    shared = [p[0] for p in params]
    if op == "lstm":  # float32 on CPU: the mkldnn path (float64 takes the decomposition, whose jacfwd works)
        shared, hx32 = [p.float() for p in shared], [h.float() for h in hx]
        with pytest.raises(NotImplementedError, match="mkldnn_rnn_layer"):
            jacfwd(lambda sample: _call(config, sample, hx32, shared)[0])(x.float())
    else:
        jacfwd(lambda sample: _call(config, sample, hx, shared)[0])(x)


def test_grad_inside_use_runs_pytorchs_own_op() -> None:
    config = Config("gru")
    generator = torch.Generator().manual_seed(7)
    params, x, hx = _params(config, generator), _input(config, generator, batch=None), _hx(config, generator)
    with registry.use(record=True) as run:
        got = grad(lambda w: _loss(_call(config, x, hx, w)))(params)
    assert run.calls["gru.input"] == 1 and run.decisions[0].kind == "native"  # reached, decided native
    leaves = [p.clone().requires_grad_() for p in params]
    for g, e in zip(got, torch.autograd.grad(_loss(_call(config, x, hx, leaves)), leaves), strict=True):
        torch.testing.assert_close(g, e)


# --- dropout between layers ----------------------------------------------------------------------------------------


def test_dropout_draws_what_pytorch_draws_outside_vmap() -> None:
    config = Config("gru", num_layers=3, bidirectional=True)
    generator = torch.Generator().manual_seed(8)
    params, x, hx = _params(config, generator), _input(config, generator, batch=None), _hx(config, generator)
    torch.manual_seed(11)
    expected = _call(config, x, hx, params, dropout=0.5, train=True)
    torch.manual_seed(11)
    got = recurrent.gru_unrolled(x, hx, params, True, 3, 0.5, True, True, False)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


def test_dropout_under_vmap_follows_vmaps_randomness() -> None:
    config = Config("lstm", num_layers=2)
    generator = torch.Generator().manual_seed(9)
    params, x, hx = _params(config, generator), _input(config, generator), _hx(config, generator)
    run = lambda sample: _call(config, sample, hx, params, dropout=0.5, train=True)[0]  # noqa: E731
    with registry.use():
        with pytest.raises(RuntimeError, match="vmap: called random operation while in randomness error mode"):
            vmap(run)(x)
        torch.manual_seed(12)
        same = vmap(run, randomness="same")(x)
        different = _no_fallback(lambda: vmap(run, randomness="different")(x))
    # randomness="same": one mask for every sample, what a loop reseeding before each sample draws.
    expected = []
    for b in range(SAMPLES):
        torch.manual_seed(12)
        expected.append(_call(config, x[b], hx, params, dropout=0.5, train=True)[0])
    torch.testing.assert_close(same, torch.stack(expected))
    assert different.shape == same.shape and not torch.allclose(different, same)


# --- packed sequences (.data) --------------------------------------------------------------------------------------

LENGTHS = torch.tensor([4, 3, 3, 1])


def _packed_module(op: str, bidirectional: bool) -> nn.Module:
    torch.manual_seed(13)
    kind = {"rnn_tanh": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}[op]
    return kind(FEATURES, H, num_layers=2, bidirectional=bidirectional).double()


@pytest.mark.parametrize("op", ["rnn_tanh", "gru", "lstm"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["one-way", "bidirectional"])
def test_packed_sequences_under_vmap_equal_the_loop(op: str, bidirectional: bool) -> None:
    """Packed outside vmap, the packed data batched, batch_sizes shared: nn.RNN/GRU/LSTM reach the .data overload."""
    module = _packed_module(op, bidirectional)
    generator = torch.Generator().manual_seed(14)
    padded = torch.randn(SAMPLES, 4, len(LENGTHS), FEATURES, generator=generator, dtype=torch.float64)
    packs = [pack_padded_sequence(padded[b], LENGTHS) for b in range(SAMPLES)]
    batch_sizes = packs[0].batch_sizes
    data = torch.stack([p.data for p in packs])
    params = {name: p.detach() for name, p in module.named_parameters()}

    def run(weights: dict[str, torch.Tensor], sample: torch.Tensor):
        packed = torch.nn.utils.rnn.PackedSequence(sample, batch_sizes)
        out, state = torch.func.functional_call(module, weights, (packed,))
        return out.data, state[0] if op == "lstm" else state

    def loss(weights: dict[str, torch.Tensor], sample: torch.Tensor) -> torch.Tensor:
        return _loss(run(weights, sample))

    expected_out, expected_grads = [], []
    for b in range(SAMPLES):
        leaves = {name: p.clone().requires_grad_() for name, p in params.items()}
        result = run(leaves, data[b])
        expected_out.append(tuple(o.detach() for o in result))
        expected_grads.append(torch.autograd.grad(_loss(result), list(leaves.values())))
    with pytest.raises(RuntimeError, match=f"Batching rule not implemented for aten::{op}.data"):
        vmap(run, in_dims=(None, 0))(params, data)
    with registry.use():
        out = _no_fallback(lambda: vmap(run, in_dims=(None, 0))(params, data))
        grads = _no_fallback(lambda: vmap(grad(loss), in_dims=(None, 0))(params, data))
    for g, e in zip(out, zip(*expected_out, strict=True), strict=True):
        torch.testing.assert_close(g, torch.stack(e))
    for name, e in zip(params, zip(*expected_grads, strict=True), strict=True):
        torch.testing.assert_close(grads[name], torch.stack(e))


def test_packed_composite_equals_native_outside_transforms() -> None:
    config = Config("lstm", num_layers=2, bidirectional=True, proj_size=2)
    generator = torch.Generator().manual_seed(15)
    params = _params(config, generator)
    hx = [torch.randn(4, len(LENGTHS), 2, generator=generator, dtype=torch.float64),
          torch.randn(4, len(LENGTHS), H, generator=generator, dtype=torch.float64)]
    padded = torch.randn(4, len(LENGTHS), FEATURES, generator=generator, dtype=torch.float64)
    packed = pack_padded_sequence(padded, LENGTHS)
    expected = aten.lstm.data(packed.data, packed.batch_sizes, hx, params, True, 2, 0.0, False, True)
    got = recurrent.lstm_unrolled_packed(packed.data, packed.batch_sizes, hx, params, True, 2, 0.0, False, True)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


# --- bad input gets a clear error ----------------------------------------------------------------------------------


def test_wrong_parameter_count_says_what_is_expected() -> None:
    config = Config("gru", num_layers=2)
    generator = torch.Generator().manual_seed(16)
    params, x, hx = _params(config, generator)[:-1], _input(config, generator), _hx(config, generator)
    with registry.use(), pytest.raises(ValueError) as raised:
        vmap(lambda sample: _call(config, sample, hx, params))(x)
    assert str(raised.value) == ("gru: got 7 parameter tensors for 2 layer(s), one direction, has_biases=True: "
                                 "expected 8, as nn.RNN, nn.GRU and nn.LSTM pass their _flat_weights")


# --- the cell ops: a per-sample loop over nn.RNNCell / nn.GRUCell from a shared zero state ---------------------------


@pytest.mark.parametrize(("make", "op"), [(lambda: torch.nn.RNNCell(3, 5), "rnn_tanh_cell"),
                                          (lambda: torch.nn.RNNCell(3, 5, nonlinearity="relu"), "rnn_relu_cell"),
                                          (lambda: torch.nn.GRUCell(3, 5), "gru_cell")])
def test_unrolled_cells_from_a_shared_zero_state_equal_the_loop(make, op: str) -> None:
    """The first step's hx is the shared ``torch.zeros(1, hidden)``: PyTorch's cell adds the batched input gates into
    it in place and vmap refuses; inside use() that step runs the functional composite, the later ones (hx batched)
    PyTorch's own, and the per-sample gradients equal the loop's."""
    torch.manual_seed(0)
    cell = make().double()
    params = {name: p.detach() for name, p in cell.named_parameters()}
    inputs = torch.randn(4, 6, 3, dtype=torch.float64)

    def loss(p: dict[str, torch.Tensor], sequence: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(1, 5, dtype=torch.float64)
        for step in sequence:
            h = torch.func.functional_call(cell, p, (step[None], h))
        return h.pow(2).sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        per_sample(params, inputs)
    with registry.use(record=True) as run:
        got = per_sample(params, inputs)
    assert {d.composite for d in run.decisions if d.op == op} == {"functional", "native"}
    # The loop: torch.autograd per sequence, outside any transform.
    expected = []
    for sequence in inputs:
        leaves = {name: p.clone().requires_grad_() for name, p in params.items()}
        expected.append(dict(zip(leaves, torch.autograd.grad(loss(leaves, sequence), list(leaves.values())),
                                 strict=True)))
    for name in params:
        torch.testing.assert_close(got[name], torch.stack([e[name] for e in expected]))


def _lstm_cell_loss(cell: nn.LSTMCell, p: dict[str, torch.Tensor], sequence: torch.Tensor) -> torch.Tensor:
    h = c = torch.zeros(1, cell.hidden_size, dtype=torch.float64)
    for step in sequence:
        h, c = torch.func.functional_call(cell, p, (step[None], (h, c)))
    return (h.pow(2) + c).sum()


def test_unrolled_lstm_cell_from_a_shared_zero_state_equals_the_loop() -> None:
    """lstm_cell takes its state as the Tensor[] ``hx = [h, c]``: the first step's h is the shared zeros, PyTorch's cell
    adds the batched input gates into ``linear_hh(h)`` in place and vmap refuses; inside use() that step runs the
    functional composite, the later ones (h batched) PyTorch's own, and the per-sample gradients equal the loop's."""
    torch.manual_seed(0)
    cell = nn.LSTMCell(3, 5).double()
    params = {name: p.detach() for name, p in cell.named_parameters()}
    inputs = torch.randn(4, 6, 3, dtype=torch.float64)
    per_sample = vmap(grad(lambda p, s: _lstm_cell_loss(cell, p, s)), in_dims=(None, 0))
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        per_sample(params, inputs)
    with registry.use(record=True) as run:
        got = per_sample(params, inputs)
    assert {d.composite for d in run.decisions if d.op == "lstm_cell"} == {"functional", "native"}
    for b, sequence in enumerate(inputs):
        leaves = {name: p.clone().requires_grad_() for name, p in params.items()}
        expected = torch.autograd.grad(_lstm_cell_loss(cell, leaves, sequence), list(leaves.values()))
        for name, want in zip(leaves, expected, strict=True):
            torch.testing.assert_close(got[name][b], want)


@pytest.mark.parametrize("bias", [True, False])
def test_lstm_cell_composite_equals_pytorch_values_and_gradients(bias: bool) -> None:
    """The functional composite against aten::lstm_cell outside any transform: both outputs and every gradient."""
    generator = torch.Generator().manual_seed(3)
    x, h, c = (torch.randn(2, n, dtype=torch.float64, generator=generator) for n in (3, 5, 5))
    weights = [torch.randn(20, 3, dtype=torch.float64, generator=generator),
               torch.randn(20, 5, dtype=torch.float64, generator=generator)]
    if bias:
        weights += [torch.randn(20, dtype=torch.float64, generator=generator) for _ in range(2)]
    leaves = [t.requires_grad_() for t in (x, h, c, *weights)]
    for fn in (torch.lstm_cell, recurrent.lstm_cell_functional):
        out = fn(leaves[0], [leaves[1], leaves[2]], *leaves[3:])
        grads = torch.autograd.grad((out[0].sin() + out[1].cos()).sum(), leaves)
        if fn is torch.lstm_cell:
            expected, expected_grads = out, grads
    for got, want in zip((*out, *grads), (*expected, *expected_grads), strict=True):
        torch.testing.assert_close(got, want)


def test_lstm_cell_decisions_follow_whether_h_is_batched_in_one_block() -> None:
    """Under plain vmap PyTorch's lstm_cell raises (no batching rule, and no fallback for its Tensor[] hx); under
    vmap(jvp) it decomposes and runs where h is batched. The decision key holds each tensor of hx: in one use() block
    a vmap(jvp) call with h batched (PyTorch's op) and one with h shared (the composite) each get their own decision,
    and every result equals the loop."""
    generator = torch.Generator().manual_seed(5)
    x, tangent = (torch.randn(4, 1, 3, dtype=torch.float64, generator=generator) for _ in range(2))
    h_batched, c_batched = (torch.randn(4, 1, 5, dtype=torch.float64, generator=generator) for _ in range(2))
    h_shared, c_shared = (torch.randn(1, 5, dtype=torch.float64, generator=generator) for _ in range(2))
    w_ih, w_hh = (torch.randn(20, n, dtype=torch.float64, generator=generator) for n in (3, 5))

    def step(x, h, c):
        return torch.lstm_cell(x, [h, c], w_ih, w_hh)

    def tangent_of(x, h, c, t):
        return torch.func.jvp(lambda x: step(x, h, c)[1], (x,), (t,))[1]

    with pytest.raises(RuntimeError, match="We could not generate a fallback"):
        vmap(step)(x, h_batched, c_batched)
    with registry.use(record=True) as run:
        got = vmap(step)(x, h_batched, c_batched)
        got_batched = vmap(tangent_of)(x, h_batched, c_batched, tangent)
        got_shared = vmap(tangent_of, in_dims=(0, None, None, 0))(x, h_shared, c_shared, tangent)
    assert [d.composite for d in run.decisions if d.op == "lstm_cell"] == ["functional", "native", "functional"]
    for b in range(4):
        for got_output, want in zip(got, step(x[b], h_batched[b], c_batched[b]), strict=True):
            torch.testing.assert_close(got_output[b], want)
        torch.testing.assert_close(got_batched[b], tangent_of(x[b], h_batched[b], c_batched[b], tangent[b]))
        torch.testing.assert_close(got_shared[b], tangent_of(x[b], h_shared, c_shared, tangent[b]))


@pytest.mark.parametrize("op", ["rnn_tanh_cell", "rnn_relu_cell", "gru_cell"])
def test_cells_under_plain_vmap_run_batched_not_in_vmaps_loop(op: str) -> None:
    """Under plain vmap the cell ops reach vmap undecomposed and loop (the fallback warning); inside use() the
    composite runs, with no warning, and equals the loop. A batch of one keeps PyTorch's op (one call)."""
    gates = 3 if op == "gru_cell" else 1
    generator = torch.Generator().manual_seed(7)
    x, h = torch.randn(4, 1, 3, generator=generator), torch.randn(4, 1, 5, generator=generator)
    w_ih, w_hh = torch.randn(gates * 5, 3, generator=generator), torch.randn(gates * 5, 5, generator=generator)
    fn = getattr(torch, op)
    with fallback.watch() as caught:
        vmap(lambda x, h: fn(x, h, w_ih, w_hh))(x, h)
    assert fallback.fallback_note(caught) is not None
    with fallback.watch() as caught, registry.use(record=True) as run:
        got = vmap(lambda x, h: fn(x, h, w_ih, w_hh))(x, h)
    assert fallback.fallback_note(caught) is None
    with registry.use(record=True) as single:
        vmap(lambda x, h: fn(x, h, w_ih, w_hh))(x[:1], h[:1])
    assert [d.composite for d in run.decisions if d.op == op] == ["functional"]
    assert [d.composite for d in single.decisions if d.op == op] == ["native"]
    for b in range(4):
        torch.testing.assert_close(got[b], fn(x[b], h[b], w_ih, w_hh))


def test_lstm_cell_composite_rejects_what_pytorch_rejects() -> None:
    x, h = torch.randn(2, 3), torch.zeros(1, 5)
    w_ih, w_hh = torch.randn(20, 3), torch.randn(20, 5)
    with pytest.raises(RuntimeError) as native:
        torch.lstm_cell(x, [h], w_ih, w_hh)
    with registry.use(), pytest.raises(RuntimeError) as routed:
        vmap(lambda x: torch.lstm_cell(x, [h], w_ih, w_hh))(x[:, None])
    assert str(routed.value) == str(native.value) == "lstm_cell expects two hidden states"


@pytest.mark.usefixtures("cpp_routing")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("lead", [(), (3,)], ids=["one-sample", "per-sample-lead"])
def test_recurrence_steps_in_cpp_equal_the_python_steps(lead: tuple[int, ...], reverse: bool, dtype: torch.dtype,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The LSTM recurrence primitive's steps in C++ (registry/core/kernels/recurrence.cpp: one product and one pass
    over the gates a step) give the Python steps' outputs, states and BPTT gradients, the hidden weight's per
    leading (per-sample) index, forward and reversed."""
    generator = torch.Generator().manual_seed(11)
    steps, batch, hidden = 5, 2, 4

    def randn(*sizes: int) -> torch.Tensor:
        return torch.randn(*sizes, generator=generator, dtype=dtype)

    projected, h0, c0 = randn(*lead, steps, batch, 4 * hidden), randn(*lead, batch, hidden), randn(*lead, batch, hidden)
    w_hh = randn(4 * hidden, hidden) / 2
    d_out, d_h, d_c = randn(*lead, steps, batch, hidden), randn(*lead, batch, hidden), randn(*lead, batch, hidden)
    ops = recurrent._cpp_steps(projected, (h0, c0, d_h, d_c), w_hh, others=(d_out,))
    assert ops is not None
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    out, h, c, _ = recurrent._lstm_steps(projected, h0, c0, w_hh, reverse, keep=False)
    for got, want in zip(ops.lstm_recurrence(projected, h0, c0, w_hh, reverse), (out, h, c), strict=True):
        torch.testing.assert_close(got, want, **tolerance)
    monkeypatch.setattr(recurrent, "_cpp_steps", lambda *tensors, **kinds: None)  # the primitive's Python BPTT
    want = recurrent.LSTMRecurrenceBackward.forward(projected, h0, c0, w_hh, d_out, d_h, d_c, reverse)
    got = ops.lstm_steps_backward(projected, h0, c0, w_hh, d_out, d_h, d_c, reverse)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tolerance)



@pytest.mark.usefixtures("cpp_routing")
@pytest.mark.parametrize("bias", [True, False], ids=["hidden-bias", "no-bias"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("lead", [(), (3,)], ids=["one-sample", "per-sample-lead"])
def test_gru_recurrence_steps_in_cpp_equal_the_python_steps(lead: tuple[int, ...], reverse: bool, bias: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The GRU recurrence primitive's steps in C++ give the Python steps' outputs, last state and BPTT gradients
    (the projection's, h0's, and the hidden weight's and bias's per leading index), with and without a hidden
    bias, forward and reversed."""
    generator = torch.Generator().manual_seed(12)
    steps, batch, hidden = 5, 2, 4

    def randn(*sizes: int) -> torch.Tensor:
        return torch.randn(*sizes, generator=generator, dtype=torch.float64)

    projected, h0 = randn(*lead, steps, batch, 3 * hidden), randn(*lead, batch, hidden)
    w_hh, b_hh = randn(3 * hidden, hidden) / 2, randn(3 * hidden) if bias else None
    d_out, d_h = randn(*lead, steps, batch, hidden), randn(*lead, batch, hidden)
    ops = recurrent._cpp_steps(projected, (h0, d_h), w_hh, bias=b_hh, others=(d_out,))
    assert ops is not None
    out, h, _ = recurrent._gru_steps(projected, h0, w_hh, b_hh, reverse, keep=False)
    for got, want in zip(ops.gru_recurrence(projected, h0, w_hh, b_hh, reverse), (out, h), strict=True):
        torch.testing.assert_close(got, want)
    monkeypatch.setattr(recurrent, "_cpp_steps", lambda *tensors, **kinds: None)  # the primitive's Python BPTT
    want = recurrent.GRURecurrenceBackward.forward(projected, h0, w_hh, b_hh, d_out, d_h, reverse)
    got = ops.gru_steps_backward(projected, h0, w_hh, b_hh, d_out, d_h, reverse)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("make", [nn.LSTM, nn.GRU, nn.RNN], ids=["lstm", "gru", "rnn"])
def test_a_sequence_of_no_steps_is_refused_as_pytorch_refuses_it(make: Callable[..., nn.Module]) -> None:
    """A zero-length sequence under vmap(grad): PyTorch's error inside use() too (the C++ steps would take it)."""
    torch.manual_seed(0)
    model = make(3, 4)
    params = {name: p.detach() for name, p in model.named_parameters()}
    x = torch.randn(2, 0, 1, 3)

    def loss(p: dict[str, torch.Tensor], sample: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (sample,))[0].sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0))
    with pytest.raises(RuntimeError) as native:
        per_sample(params, x)
    with registry.use(), pytest.raises(RuntimeError) as routed:
        per_sample(params, x)
    assert str(routed.value) == str(native.value) == "Expected sequence length to be larger than 0 in RNN"


# --- the recurrences as C++ ops (registry/core/kernels/recurrence.cpp: NOTE [recurrence ops]) --------------------


def _recurrence_inputs(op: str, generator: torch.Generator, dtype: torch.dtype = torch.float64,
                       lead: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...]:
    """(projected, h0[, c0], w_hh[, b_hh]) of one direction: ``lead`` leading (per-sample) dimensions on the
    projection and the states, none on the weights."""
    gates = 4 if op == "lstm" else 3

    def randn(*sizes: int) -> torch.Tensor:
        return torch.randn(*sizes, generator=generator, dtype=dtype)

    projected, h0 = randn(*lead, T, N, gates * H), randn(*lead, N, H)
    w_hh = randn(gates * H, H) / 2
    if op == "lstm":
        return projected, h0, randn(*lead, N, H), w_hh
    return projected, h0, w_hh, randn(gates * H)


def _recurrence_op(op: str) -> Callable[..., tuple[torch.Tensor, ...]]:
    return torch.ops.multicomposite.lstm_recurrence if op == "lstm" else torch.ops.multicomposite.gru_recurrence


def _python_recurrence(op: str, *inputs: torch.Tensor, reverse: bool) -> tuple[torch.Tensor, ...]:
    """The reference: the Python steps, differentiated by autograd op by op."""
    if op == "lstm":
        out, h, c, _ = recurrent._lstm_steps(*inputs, reverse, keep=False)
        return out, h, c
    out, h, _ = recurrent._gru_steps(*inputs, reverse, keep=False)
    return out, h


@pytest.mark.usefixtures("cpp_routing")
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("op", ["lstm", "gru"])
def test_recurrence_op_gradients_equal_autograd_of_the_python_steps(op: str, reverse: bool) -> None:
    """Outside any transform the op records one node whose backward gives what autograd of the Python steps gives,
    for every input (a loss that weighs every output and state)."""
    generator = torch.Generator().manual_seed(21)
    inputs = [t.requires_grad_() for t in _recurrence_inputs(op, generator)]
    weights = [torch.randn(t.shape, generator=generator, dtype=torch.float64)
               for t in _python_recurrence(op, *inputs, reverse=reverse)]
    got_outputs = _recurrence_op(op)(*inputs, reverse)
    assert got_outputs[0].grad_fn.name() == f"multicomposite::{op.upper()}RecurrenceBackward"
    want_outputs = _python_recurrence(op, *inputs, reverse=reverse)
    for got, want in zip(got_outputs, want_outputs, strict=True):
        torch.testing.assert_close(got, want)
    got = torch.autograd.grad(sum((o * w).sum() for o, w in zip(got_outputs, weights, strict=True)), inputs)
    want = torch.autograd.grad(sum((o * w).sum() for o, w in zip(want_outputs, weights, strict=True)), inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.usefixtures("cpp_routing")
@pytest.mark.parametrize("op", ["lstm", "gru"])
def test_recurrence_op_under_nested_vmap_of_grad_equals_the_loop(op: str) -> None:
    """vmap(vmap(grad)): each level's batching rule adds its batch dimension as one more leading dimension of one
    call; the per-sample gradients of the projection, the states (shared h0: not batched) and the hidden weight equal
    one autograd call per sample of the Python steps."""
    generator = torch.Generator().manual_seed(22)
    projected, h0, *rest = _recurrence_inputs(op, generator, lead=(2, 3))
    h0 = h0[0, 0]  # one initial state for every sample

    def loss(projected: torch.Tensor, h0: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return sum(o.square().sum() for o in _recurrence_op(op)(projected, h0, *rest, False))

    in_dims = (0, None, *((0,) if op == "lstm" else ()), None, *(() if op == "lstm" else (None,)))
    states = rest[:1] if op == "lstm" else ()
    weights = rest[1:] if op == "lstm" else rest
    got = vmap(vmap(grad(loss, argnums=tuple(range(len(rest) + 2))), in_dims=in_dims), in_dims=in_dims)(
        projected, h0, *states, *weights)
    for i in range(2):
        for j in range(3):
            sample = [projected[i, j].clone().requires_grad_(), h0.clone().requires_grad_(),
                      *(s[i, j].clone().requires_grad_() for s in states), *(w.clone().requires_grad_()
                                                                             for w in weights)]
            outputs = _python_recurrence(op, *sample, reverse=False)
            want = torch.autograd.grad(sum(o.square().sum() for o in outputs), sample)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g[i, j], w)


@pytest.mark.usefixtures("cpp_routing")
@pytest.mark.parametrize("op", ["lstm", "gru"])
def test_per_sample_gradients_inside_use_run_the_recurrence_op(op: str) -> None:
    """nn.LSTM and nn.GRU under vmap(grad) inside use(): the op, its keeping forward and its backward from the kept
    activations run (not the Python primitive), and the per-sample gradients equal the loop."""
    torch.manual_seed(0)
    model = (nn.LSTM if op == "lstm" else nn.GRU)(FEATURES, H, num_layers=2, bidirectional=True).double()
    params = {name: p.detach() for name, p in model.named_parameters()}
    x = torch.randn(SAMPLES, T, N, FEATURES, dtype=torch.float64)

    def loss(p: dict[str, torch.Tensor], sample: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (sample,))[0].square().sum()

    primitive = recurrent.LSTMRecurrence if op == "lstm" else recurrent.GRURecurrence
    with registry.use(), torch.profiler.profile() as profile:
        forward = primitive.forward
        primitive.forward = None  # type: ignore[assignment]  # the primitive must not run
        try:
            got = vmap(grad(loss), in_dims=(None, 0))(params, x)
        finally:
            primitive.forward = forward  # type: ignore[method-assign]
    names = {event.name for event in profile.events()}
    assert {f"multicomposite::{op}_recurrence", f"multicomposite::{op}_recurrence_keeping",
            f"multicomposite::{op}_recurrence_backward"} <= names
    assert f"multicomposite::{op}_steps_backward" not in names  # the kept activations, not the forward again
    for name, value in got.items():
        want = torch.stack([torch.autograd.grad(loss(dict(model.named_parameters()), x[b]),
                                                dict(model.named_parameters())[name])[0] for b in range(SAMPLES)])
        torch.testing.assert_close(value, want)


@pytest.mark.usefixtures("cpp_routing")
def test_recurrence_op_is_not_taken_where_the_primitive_must_run() -> None:
    """A hidden weight batched at some level (an ensemble), forward AD, a functionalize level, a half-precision
    tensor, a weight of another gate count: the primitive (None); plain float tensors and parameters: the op."""
    generator = torch.Generator().manual_seed(23)
    projected, h0, c0, w_hh = _recurrence_inputs("lstm", generator, dtype=torch.float32)
    assert recurrent._recurrence_ops(4, projected, (h0, c0), w_hh) is torch.ops.multicomposite
    assert recurrent._recurrence_ops(4, projected, (h0, c0), nn.Parameter(w_hh)) is torch.ops.multicomposite
    assert recurrent._recurrence_ops(3, projected, (h0, c0), w_hh) is None  # a GRU's gate count: not this weight
    assert recurrent._recurrence_ops(4, projected.half(), (h0.half(), c0.half()), w_hh.half()) is None
    ensemble = torch.stack([w_hh, w_hh])
    assert vmap(lambda w: torch.tensor(recurrent._recurrence_ops(4, projected, (h0, c0), w) is None))(ensemble).all()
    assert vmap(lambda p: torch.tensor(recurrent._recurrence_ops(4, p, (h0, c0), w_hh) is not None))(
        torch.stack([projected, projected])).all()
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(projected, torch.ones_like(projected))
        assert recurrent._recurrence_ops(4, dual, (h0, c0), w_hh) is None
    seen: list[object] = []
    torch.func.functionalize(lambda p: seen.append(recurrent._recurrence_ops(4, p, (h0, c0), w_hh)) or p)(projected)
    assert seen == [None]


@pytest.mark.usefixtures("cpp_routing")
def test_recurrence_ops_refuse_what_they_do_not_take() -> None:
    """A second derivative through the backward op, forward AD, and a batched hidden weight: each a clear error."""
    generator = torch.Generator().manual_seed(24)
    projected, h0, c0, w_hh = (t.requires_grad_() for t in _recurrence_inputs("lstm", generator))
    out, _, _ = torch.ops.multicomposite.lstm_recurrence(projected, h0, c0, w_hh, False)
    (d_w,) = torch.autograd.grad(out.square().sum(), (w_hh,), create_graph=True)
    with pytest.raises(RuntimeError, match="lstm_recurrence_backward has no derivative"):
        torch.autograd.grad(d_w.sum(), (w_hh,))
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(projected.detach(), torch.ones_like(projected))
        with pytest.raises(RuntimeError, match="lstm_recurrence has no forward AD"):
            torch.ops.multicomposite.lstm_recurrence(dual, h0, c0, w_hh, False)
        with pytest.raises(RuntimeError, match="gru_recurrence has no forward AD"):  # nothing requires grad
            torch.ops.multicomposite.gru_recurrence(dual[..., :3 * H], h0.detach(), w_hh.detach()[:3 * H], None,
                                                    False)
    with pytest.raises(RuntimeError, match="takes a hidden weight and bias that vmap does not batch"):
        vmap(lambda w: torch.ops.multicomposite.lstm_recurrence(projected, h0, c0, w, False)[0])(
            torch.stack([w_hh, w_hh]).detach())


@pytest.mark.usefixtures("cpp_routing")
@pytest.mark.parametrize("make", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def test_input_gradients_through_a_module_with_its_own_parameters_run_the_recurrence_op(
        make: Callable[..., nn.Module]) -> None:
    """vmap(grad) of a loss of the module's input inside use(), the module's own parameters (nn.Parameter, no
    functional_call): the op runs (not the primitive), and each sample's input gradient equals autograd's on that
    sample alone."""
    torch.manual_seed(1)
    model = make(FEATURES, H, num_layers=2, bidirectional=True).double()
    x = torch.randn(SAMPLES, T, N, FEATURES, dtype=torch.float64)

    def loss(sample: torch.Tensor) -> torch.Tensor:
        return model(sample)[0].square().sum()

    with registry.use(), torch.profiler.profile() as profile:
        got = vmap(grad(loss))(x)
    assert f"multicomposite::{make.__name__.lower()}_recurrence" in {event.name for event in profile.events()}
    want = torch.stack([_input_gradient(loss, x[b]) for b in range(SAMPLES)])
    torch.testing.assert_close(got, want)


def _input_gradient(loss: Callable[[torch.Tensor], torch.Tensor], sample: torch.Tensor) -> torch.Tensor:
    """The reference: autograd on one sample, no transform."""
    sample = sample.clone().requires_grad_()
    return torch.autograd.grad(loss(sample), sample)[0]
