"""Models of a real library (the ``transformers`` package, the ``models`` extra): GPT-2 and BERT from tiny configs
with random weights, nothing downloaded. Their default attention is ``F.scaled_dot_product_attention``: natively
vmap loops over PyTorch's fused kernel, forward and backward; inside ``use()`` per-sample gradients through
``functional_call`` run with no fallback and equal the per-sample ``torch.autograd`` loop.

With an ``attention_mask`` that pads some samples, the library's mask code asks ``padding_mask.all()`` in Python,
which vmap cannot answer for a batched mask: natively it raises; inside ``use()`` the question is answered per sample
(registry/core/control_flow.py; docs/attention.md)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import func, nn

import registry

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched: the models are built from configs
transformers = pytest.importorskip("transformers")

BATCH, LENGTH, VOCAB, LABELS = 4, 8, 50, 3
TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}


def _fallbacks(caught: list) -> set[str]:
    return {str(w.message).split("batching rule for ")[1].split(".")[0] for w in caught
            if "There is a performance drop" in str(w.message)}


def _gpt2() -> tuple[nn.Module, Callable[[torch.Tensor, torch.Tensor], dict[str, Any]]]:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0)
    return transformers.GPT2LMHeadModel(config), lambda ids, _: {"input_ids": ids, "labels": ids}


def _bert() -> tuple[nn.Module, Callable[[torch.Tensor, torch.Tensor], dict[str, Any]]]:
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=LABELS)
    return transformers.BertForSequenceClassification(config), lambda ids, y: {"input_ids": ids, "labels": y}


MODELS = {"gpt2": _gpt2, "bert": _bert}


def _setup(name: str):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.eval()  # no dropout
    assert model.config._attn_implementation == "sdpa"  # the library's default: F.scaled_dot_product_attention
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
    labels = torch.randint(0, LABELS, (BATCH,), generator=generator)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return func.functional_call(model, p, (), inputs(x.unsqueeze(0), y.unsqueeze(0))).loss

    return model, inputs, ids, labels, params, func.vmap(func.grad(loss), in_dims=(None, 0, 0))


def _loop(model: nn.Module, inputs, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    grads: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for b in range(BATCH):
        model.zero_grad(set_to_none=True)
        model(**inputs(ids[b:b + 1], labels[b:b + 1])).loss.backward()
        for n, p in model.named_parameters():
            grads[n].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    return {n: torch.stack(each) for n, each in grads.items()}


@pytest.mark.parametrize("pins", [None, {"scaled_dot_product_attention": "primitive"}], ids=["auto", "primitive"])
@pytest.mark.parametrize("name", list(MODELS))
def test_per_sample_gradients_inside_use_equal_the_loop(name: str, pins: dict[str, str] | None,
                                                        fallback_warnings: list) -> None:
    """Pinned, the folded fused kernel runs and nothing loops; under auto native's loop over the fused kernel may be
    the choice by cost at these small sizes (registry/core/cost.py), and nothing else loops."""
    model, inputs, ids, labels, params, per_sample = _setup(name)
    with registry.use(pins=pins):
        grads = per_sample(params, ids, labels)
    fused = {"aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}
    assert _fallbacks(fallback_warnings) <= (fused if pins is None else set())
    expected = _loop(model, inputs, ids, labels)
    assert set(grads) == set(expected)
    for key, want in expected.items():
        torch.testing.assert_close(grads[key], want, **TOLERANCE, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("name", list(MODELS))
def test_natively_vmap_loops_over_the_fused_kernel(name: str, fallback_warnings: list) -> None:
    model, inputs, ids, labels, params, per_sample = _setup(name)
    grads = per_sample(params, ids, labels)
    assert _fallbacks(fallback_warnings) == {"aten::_scaled_dot_product_flash_attention_for_cpu",
                                             "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}
    expected = _loop(model, inputs, ids, labels)
    for key, want in expected.items():  # slow, not wrong
        torch.testing.assert_close(grads[key], want, **TOLERANCE)


@pytest.mark.parametrize("name", list(MODELS))
def test_padded_batches_fail_natively_and_equal_the_loop_inside_use(name: str) -> None:
    """With an ``attention_mask`` that pads some samples and not others, the library asks ``padding_mask.all()`` in
    Python: natively vmap raises its data-dependent error; inside ``use()`` the question is answered per sample
    (registry/core/control_flow.py) and the per-sample gradients equal the loop's."""
    model, inputs, ids, labels, params, _ = _setup(name)
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, 5:] = 0
    mask[3, 3:] = 0

    def masked(x: torch.Tensor, y: torch.Tensor, m: torch.Tensor) -> dict[str, Any]:
        return {**inputs(x, y), "attention_mask": m}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return func.functional_call(model, p, (), masked(x[None], y[None], m[None])).loss

    per_sample = func.vmap(func.grad(loss), in_dims=(None, 0, 0, 0))
    with pytest.raises(RuntimeError, match="data-dependent control flow"):
        per_sample(params, ids, labels, mask)
    with registry.use():
        grads = per_sample(params, ids, labels, mask)
    expected: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for b in range(BATCH):
        model.zero_grad(set_to_none=True)
        model(**masked(ids[b:b + 1], labels[b:b + 1], mask[b:b + 1])).loss.backward()
        for n, p in model.named_parameters():
            expected[n].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    for key, want in expected.items():
        torch.testing.assert_close(grads[key], torch.stack(want), **TOLERANCE, msg=lambda m, key=key: f"{key}: {m}")
