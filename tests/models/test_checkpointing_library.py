"""A real library's activation checkpointing under vmap(grad): GPT-2 of the ``transformers`` package (the ``models``
extra) from a tiny config with random weights, nothing downloaded, with ``gradient_checkpointing_enable()`` (its
non-reentrant default and the reentrant form) in training mode (no dropout). Natively per-sample gradients fail: the
library hooks the input embeddings to call ``output.requires_grad_(True)``, which functorch refuses, and behind it
each checkpoint form fails on its own. Inside ``use()`` they run with the activations kept and equal the per-sample
``torch.autograd`` loop, which checkpoints."""

from __future__ import annotations

import os

import pytest
import torch
from torch import func

import registry
from registry.core import legacy_functions

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

BATCH, LENGTH, VOCAB = 3, 6, 40
TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}


FORMS = {"non_reentrant": ("torch.utils.checkpoint (use_reentrant=False)", None),
         "reentrant": ("CheckpointFunction", {"use_reentrant": True})}


def _model(kwargs: dict[str, bool] | None) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=8, n_embd=16, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0, use_cache=False)
    model = transformers.GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()  # the library checkpoints only in training mode; every dropout probability is 0
    return model


@pytest.mark.parametrize("form", list(FORMS))
def test_per_sample_gradients_with_checkpointing_equal_the_loop(form: str) -> None:
    label, kwargs = FORMS[form]
    model = _model(kwargs)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        x = x.unsqueeze(0)
        return func.functional_call(model, p, (), {"input_ids": x, "labels": x}).loss

    per_sample = func.vmap(func.grad(loss), in_dims=(None, 0))
    with pytest.raises(RuntimeError, match="requires_grad_"):
        per_sample(params, ids)
    with registry.use():
        grads = per_sample(params, ids)
    chosen = {(d.function, d.stack): d.composite for d in legacy_functions.decisions()}
    assert chosen[(label, "vmap(grad)")] == "keep activations"
    for b in range(BATCH):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids[b:b + 1], labels=ids[b:b + 1]).loss.backward()
        for name, parameter in model.named_parameters():
            want = torch.zeros_like(parameter) if parameter.grad is None else parameter.grad
            torch.testing.assert_close(grads[name][b], want, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")
