"""Whole recurrent models under torch.func, as a user writes them: per-sample gradients of ``nn.RNN``, ``nn.GRU`` and
``nn.LSTM`` models (multi-layer, bidirectional, batch_first, given or zero initial state) and of an
``nn.Embedding(max_norm=...)`` model, through ``torch.func.functional_call`` under ``vmap(grad)`` inside ``use()``,
against a per-sample ``torch.autograd`` loop outside any transform. Natively each of them raises or loops."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import registry

SAMPLES, STEPS, FEATURES, HIDDEN, VOCAB = 4, 6, 3, 8, 20
FALLBACK = "There is a performance drop"


class SequenceClassifier(nn.Module):
    """A recurrent encoder, its last output step through a linear head."""

    def __init__(self, recurrent: nn.Module, out_features: int, with_state: bool = False) -> None:
        super().__init__()
        self.recurrent = recurrent
        self.head = nn.Linear(out_features, 2)
        self.with_state = with_state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.with_state:  # a given initial state, derived from the input so that it is per sample
            r = self.recurrent
            layers = r.num_layers * (2 if r.bidirectional else 1)
            h0 = torch.tanh(x.mean()) * torch.ones(layers, r.proj_size or r.hidden_size, dtype=x.dtype)
            state = (h0, torch.zeros(layers, r.hidden_size, dtype=x.dtype)) if isinstance(r, nn.LSTM) else h0
            out = self.recurrent(x, state)[0]
        else:
            out = self.recurrent(x)[0]
        last = out[:, -1] if self.recurrent.batch_first and out.dim() == 3 else out[-1]
        return self.head(last)


def _model(kind: str, **options: object) -> tuple[SequenceClassifier, bool]:
    torch.manual_seed(0)
    with_state = bool(options.pop("with_state", False))
    module = {"rnn": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}[kind](FEATURES, HIDDEN, **options)
    out = (module.proj_size or HIDDEN) if kind == "lstm" else HIDDEN
    return SequenceClassifier(module, out * (2 if module.bidirectional else 1), with_state).double(), \
        bool(options.get("batch_first", False))


MODELS = {
    "rnn-tanh": ("rnn", {}),
    "rnn-relu-2layer-bi": ("rnn", {"nonlinearity": "relu", "num_layers": 2, "bidirectional": True}),
    "gru": ("gru", {}),
    "gru-2layer-bi-batchfirst": ("gru", {"num_layers": 2, "bidirectional": True, "batch_first": True}),
    "gru-given-state": ("gru", {"num_layers": 2, "with_state": True}),
    "lstm": ("lstm", {}),
    "lstm-2layer-bi-batchfirst": ("lstm", {"num_layers": 2, "bidirectional": True, "batch_first": True}),
    "lstm-proj-given-state": ("lstm", {"proj_size": 4, "with_state": True}),
}


def _sample_shape(batch_first: bool, sequences: int | None) -> tuple[int, ...]:
    """What the module sees per sample: an unbatched (steps, features) sequence, or a batch of ``sequences``."""
    if sequences is None:
        return (STEPS, FEATURES)
    return (sequences, STEPS, FEATURES) if batch_first else (STEPS, sequences, FEATURES)


def _loss(model: nn.Module, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, 2), target.reshape(-1))


def _loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per sample: the module on its own, native autograd, no transform."""
    grads: list[dict[str, torch.Tensor]] = []
    for b in range(x.shape[0]):
        model.zero_grad()
        _loss(model, model(x[b]), y[b]).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    return {name: torch.stack([g[name] for g in grads]) for name in grads[0]}


def _step(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]:
    """The per-sample-gradient step: vmap(grad) of the loss through functional_call."""
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(weights: dict[str, torch.Tensor], sample: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _loss(model, functional_call(model, weights, (sample,)), target)

    return lambda x, y: vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def _fallbacks(run: Callable[[], object]) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch._C._functorch._set_vmap_fallback_warning_enabled(True)
        try:
            result = run()
        finally:
            torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    return result, [str(w.message) for w in caught if FALLBACK in str(w.message)]


def _data(batch_first: bool, sequences: int | None, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, *_sample_shape(batch_first, sequences), generator=generator, dtype=torch.float64)
    y = torch.randint(0, 2, (SAMPLES, sequences or 1), generator=generator)
    return x, y


# Per sample one unbatched sequence, or a batch of two (the models with a given state build it for one sequence).
CASES = [(name, sequences) for name in MODELS for sequences in (None, 2)
         if sequences is None or not MODELS[name][1].get("with_state")]


@pytest.mark.parametrize(("name", "sequences"), CASES,
                         ids=[f"{name}-{'one' if s is None else 'two'}-sequence" for name, s in CASES])
def test_per_sample_gradients_of_recurrent_models_equal_the_loop(name: str, sequences: int | None) -> None:
    kind, options = MODELS[name]
    model, batch_first = _model(kind, **dict(options))
    x, y = _data(batch_first, sequences)
    expected = _loop(model, x, y)
    with registry.use():
        got, fallbacks = _fallbacks(lambda: _step(model)(x, y))
    assert fallbacks == []
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("name", ["gru", "lstm-2layer-bi-batchfirst", "rnn-tanh"])
def test_natively_the_same_step_raises_or_loops(name: str) -> None:
    kind, options = MODELS[name]
    model, batch_first = _model(kind, **dict(options))
    x, y = _data(batch_first, None)
    try:
        _, fallbacks = _fallbacks(lambda: _step(model)(x, y))
    except RuntimeError as error:
        assert "doesn't match the broadcast shape" in str(error)
    else:
        assert any("aten::mkldnn_rnn_layer" in f for f in fallbacks)


# --- nn.Embedding(max_norm=...) -------------------------------------------------------------------------------------


class BagOfWords(nn.Module):
    """Embedding rows renormed to max_norm, averaged, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 6, max_norm=1.0)
        self.head = nn.Linear(6, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(-2))


def test_embedding_max_norm_model_per_sample_gradients_equal_the_loop() -> None:
    torch.manual_seed(2)
    model = BagOfWords().double()
    with torch.no_grad():
        model.embedding.weight.mul_(3)  # most rows above max_norm
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (SAMPLES, 7), generator=generator)
    y = torch.randint(0, 2, (SAMPLES, 1), generator=generator)
    before, version = model.embedding.weight.detach().clone(), model.embedding.weight._version
    expected = _loop(copy.deepcopy(model), tokens, y)
    with pytest.raises(RuntimeError, match="embedding_renorm_"):
        _step(copy.deepcopy(model))(tokens, y)
    with registry.use():
        got, fallbacks = _fallbacks(lambda: _step(model)(tokens, y))
    assert fallbacks == []
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, msg=lambda m, key=key: f"{key}: {m}")
    # The weight the samples share is not written: each sample read its own rows renormed.
    assert torch.equal(model.embedding.weight, before)
    assert model.embedding.weight._version == version


@pytest.mark.parametrize("name", ["gru-2layer-bi-batchfirst", "lstm-2layer-bi-batchfirst"])
def test_float32_models_equal_the_loop(name: str) -> None:
    """float32 on CPU: nn.LSTM's own call takes the mkldnn path there (natively vmap's per-sample loop)."""
    kind, options = MODELS[name]
    model, batch_first = _model(kind, **dict(options))
    model = model.float()
    x, y = _data(batch_first, 2)
    x = x.float()
    expected = _loop(model, x, y)
    with registry.use():
        got, fallbacks = _fallbacks(lambda: _step(model)(x, y))
    assert fallbacks == []
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, msg=lambda m, key=key: f"{key}: {m}")
