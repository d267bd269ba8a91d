"""Transformer models from ``torch.nn`` inside ``use()``: per-sample gradients through ``torch.func.functional_call``
(``vmap(grad(loss))``) and per-sample outputs (``vmap``) against a per-sample ``torch.autograd`` loop outside any
transform, with no fallback to vmap's per-sample loop: ``nn.TransformerEncoderLayer`` / ``TransformerDecoderLayer``
with padding masks, ``nn.TransformerEncoder`` of two layers, ``nn.MultiheadAttention`` (with and without weights
returned, and its fast path), ``F.scaled_dot_product_attention`` inside a small model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import func, nn

import registry

WIDTH, HEADS, LENGTH, BATCH = 16, 2, 7, 4
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def _fallbacks(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "There is a performance drop" in str(w.message)]


FUSED = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu_"
         "backward")
# Pinned, the folded fused kernel runs and nothing loops; under auto native's loop over the fused kernel may be the
# choice by cost at these small sizes (registry/core/cost.py), and nothing else loops.
PINS = [None, {"scaled_dot_product_attention": "primitive"}]


def _unexpected(caught: list, pins: dict[str, str] | None) -> list[str]:
    return [m for m in _fallbacks(caught)
            if pins is not None or m.split("batching rule for ")[1].split(".")[0] not in FUSED]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, key padding mask): each sample has its own length, True is padding."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(BATCH, LENGTH, WIDTH, generator=generator)
    lengths = torch.tensor([LENGTH, 5, 3, 6])
    return tokens, torch.arange(LENGTH).unsqueeze(0) >= lengths.unsqueeze(1)


class Decoder(nn.Module):
    """A decoder layer over the sample itself as memory, with causal self-attention and padding both ways."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(WIDTH, HEADS, 32, dropout=0.0, batch_first=True)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.size(1))
        return self.layer(tokens, tokens, tgt_mask=causal, tgt_key_padding_mask=padding,
                          memory_key_padding_mask=padding, tgt_is_causal=True)


class Encoder(nn.Module):
    def __init__(self, layers: int, norm_first: bool = False) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 32, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.encoder(tokens, src_key_padding_mask=padding)


class EncoderLayer(nn.Module):
    def __init__(self, activation: str = "relu") -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 32, dropout=0.0, batch_first=True,
                                                activation=activation)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.layer(tokens, src_key_padding_mask=padding)


class Attention(nn.Module):
    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.need_weights = need_weights
        self.attention = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        out, _ = self.attention(tokens, tokens, tokens, key_padding_mask=padding, need_weights=self.need_weights)
        return out


class SelfAttention(nn.Module):
    """Attention written the way model libraries write it: projections, heads, F.scaled_dot_product_attention with
    a boolean padding mask and a causal flag."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        batch, length, _ = tokens.shape
        q, k, v = self.qkv(tokens).view(batch, length, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        if self.causal:
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            keep = (~padding)[:, None, None, :]
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out(out.transpose(1, 2).reshape(batch, length, WIDTH))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "encoder-layer": EncoderLayer,
    "encoder-layer-gelu": lambda: EncoderLayer("gelu"),
    "encoder-2-layers": lambda: Encoder(2),
    "encoder-norm-first": lambda: Encoder(1, norm_first=True),
    "decoder-layer": Decoder,
    "multihead-attention-weights": lambda: Attention(True),
    "multihead-attention-sdpa": lambda: Attention(False),
    "sdpa-padding": lambda: SelfAttention(False),
    "sdpa-causal": lambda: SelfAttention(True),
}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()  # eval: no dropout


def _loss(model: nn.Module, params: dict[str, torch.Tensor], tokens: torch.Tensor,
          padding: torch.Tensor) -> torch.Tensor:
    out = func.functional_call(model, params, (tokens.unsqueeze(0), padding.unsqueeze(0)))
    keep = (~padding).to(out.dtype).unsqueeze(-1)  # padded positions out of the loss: their outputs are arbitrary
    return (out.squeeze(0) * keep).pow(2).sum()


def _loop_grads(model: nn.Module, tokens: torch.Tensor, padding: torch.Tensor) -> dict[str, torch.Tensor]:
    grads: dict[str, list[torch.Tensor]] = {name: [] for name, _ in model.named_parameters()}
    for b in range(BATCH):
        model.zero_grad(set_to_none=True)
        out = model(tokens[b:b + 1], padding[b:b + 1])
        keep = (~padding[b]).to(out.dtype).unsqueeze(-1)
        (out.squeeze(0) * keep).pow(2).sum().backward()
        for name, p in model.named_parameters():
            grads[name].append(p.grad.clone())
    return {name: torch.stack(each) for name, each in grads.items()}


@pytest.mark.parametrize("pins", PINS, ids=["auto", "primitive"])
@pytest.mark.parametrize("name", list(MODELS))
def test_per_sample_gradients_equal_the_loop(name: str, pins: dict[str, str] | None, fallback_warnings: list) -> None:
    model = _model(name)
    tokens, padding = _data()
    params = {n: p.detach() for n, p in model.named_parameters()}
    with registry.use(pins=pins):
        grads = func.vmap(func.grad(lambda p, x, m: _loss(model, p, x, m)), in_dims=(None, 0, 0))(
            params, tokens, padding)
    assert _unexpected(fallback_warnings, pins) == []
    expected = _loop_grads(model, tokens, padding)
    assert set(grads) == set(expected)
    for key, want in expected.items():
        torch.testing.assert_close(grads[key], want, **TOLERANCE, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("pins", PINS, ids=["auto", "primitive"])
@pytest.mark.parametrize("name", list(MODELS))
def test_per_sample_outputs_equal_the_loop(name: str, pins: dict[str, str] | None, fallback_warnings: list) -> None:
    model = _model(name)
    tokens, padding = _data()
    with registry.use(pins=pins):
        out = func.vmap(lambda x, m: model(x.unsqueeze(0), m.unsqueeze(0)).squeeze(0))(tokens, padding)
    assert _unexpected(fallback_warnings, pins) == []
    with torch.no_grad():  # outside any transform grad mode makes no difference to the values
        expected = torch.cat([model(tokens[b:b + 1], padding[b:b + 1]) for b in range(BATCH)])
    keep = ~padding
    torch.testing.assert_close(out[keep], expected[keep], **TOLERANCE)


def test_native_loops_over_the_fused_kernel_in_these_models(fallback_warnings: list) -> None:
    # The evidence: natively the same per-sample gradients take vmap's per-sample loop, forward and backward.
    model = _model("encoder-2-layers")
    tokens, padding = _data()
    params = {n: p.detach() for n, p in model.named_parameters()}
    func.vmap(func.grad(lambda p, x, m: _loss(model, p, x, m)), in_dims=(None, 0, 0))(params, tokens, padding)
    looped = {m.split("batching rule for ")[1].split(".")[0] for m in _fallbacks(fallback_warnings)}
    assert looped == {"aten::_scaled_dot_product_flash_attention_for_cpu",
                      "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}


@pytest.mark.parametrize(("name", "fused_op"), [
    ("multihead-attention-sdpa", "aten::_native_multi_head_attention"),
    ("encoder-layer", "aten::_transformer_encoder_layer_fwd"),
])
def test_inference_fast_paths_loop_and_stay_right(name: str, fused_op: str, fallback_warnings: list) -> None:
    # Eval without gradients is the modules' fast path: one fused op for the whole attention or layer, which use()
    # does not cover (docs/attention.md); vmap loops over it, natively and inside use(), and the values stay right.
    model = _model(name)
    tokens, padding = _data()
    with torch.no_grad():
        expected = torch.cat([model(tokens[b:b + 1], padding[b:b + 1]) for b in range(BATCH)])
        with registry.use():
            out = func.vmap(lambda x, m: model(x.unsqueeze(0), m.unsqueeze(0)).squeeze(0))(tokens, padding)
    looped = {m.split("batching rule for ")[1].split(".")[0] for m in _fallbacks(fallback_warnings)}
    assert looped == {fused_op}
    torch.testing.assert_close(out[~padding], expected[~padding], **TOLERANCE)
