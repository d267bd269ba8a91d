"""The models a DP-SGD user trains, under per-sample gradients: an MLP, a CNN with GroupNorm, an embedding + LayerNorm
classifier, opacus's ``DPLSTM`` and a LoRA-adapted decoder (a hand-written low-rank adapter over a frozen base).

Each runs as ``vmap(grad(loss))`` through ``functional_call`` (natively and inside ``use()``), as the per-sample
``torch.autograd`` loop (the reference), as one ordinary batched step (the floor's first part), and through the DP
library's hooks (opacus's ``GradSampleModule`` on a copy of the model, ``loss_reduction="sum"``): all four give each
sample's gradient of its own loss. opacus is imported lazily: without it the hooks column is empty (``DPLSTM`` is
opacus's own layer, so that workload needs it to run at all).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from bench.models import Setup, Workload

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def opacus_missing() -> str | None:
    """Why opacus cannot be imported (one line), or None."""
    try:
        import opacus  # noqa: F401
    except ImportError as error:
        return f"opacus is not installed ({error}): pip install 'multicomposite[models]'"
    return None


def classification_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The batch's summed cross-entropy: one sample's own loss when the batch is one sample."""
    return nn.functional.cross_entropy(logits, target, reduction="sum")


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean next-token cross-entropy, summed over the batch."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / target.shape[-1]


def per_sample_setup(model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, loss: Loss = (
        classification_loss), *, hooks: bool = True, rtol: float = 1e-4, atol: float = 1e-5) -> Setup:
    """The four ways to get the per-sample gradients of ``model``'s trainable parameters, and the batched step.

    ``model`` takes a batch (every input's first dimension); one sample runs as a batch of one. Parameters with
    ``requires_grad=False`` are frozen: no gradient is taken for them (the LoRA base).
    """
    model = model.train(False)
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    params = {name: p.detach() for name, p in trainable.items()}
    leaves = list(trainable.values())

    def sample_loss(p: dict[str, torch.Tensor], *sample: torch.Tensor) -> torch.Tensor:
        *xs, y = sample
        logits = functional_call(model, p, tuple(x.unsqueeze(0) for x in xs))
        return loss(logits, y.unsqueeze(0))

    per_sample = vmap(grad(sample_loss), in_dims=(None,) + (0,) * (len(inputs) + 1))

    def step() -> dict[str, torch.Tensor]:
        return per_sample(params, *inputs, target)

    def loop() -> dict[str, torch.Tensor]:
        rows = [torch.autograd.grad(loss(model(*(x[b:b + 1] for x in inputs)), target[b:b + 1]), leaves)
                for b in range(target.shape[0])]
        return {name: torch.stack(column) for name, column in zip(trainable, zip(*rows, strict=True), strict=True)}

    def batched() -> None:
        model.zero_grad(set_to_none=True)
        loss(model(*inputs), target).backward()

    return Setup(step=step, loop=loop, batched=batched, hooks=_opacus_hooks(model, inputs, target, loss) if hooks
                 else None, rtol=rtol, atol=atol)


def _opacus_hooks(model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
                  loss: Loss) -> Callable[[], dict[str, torch.Tensor]] | None:
    """opacus's GradSampleModule on a copy of ``model`` (its hooks would fire in the other runs too)."""
    if opacus_missing() is not None:
        return None
    from opacus import GradSampleModule

    # Training mode: the hooks record activations only then (the models have no dropout or batch norm).
    wrapped = GradSampleModule(copy.deepcopy(model).train(True), batch_first=True, loss_reduction="sum")
    named = [(name, p) for name, p in wrapped._module.named_parameters() if p.requires_grad]

    def hooks() -> dict[str, torch.Tensor]:
        for _, p in named:
            p.grad, p.grad_sample = None, None
        loss(wrapped(*inputs), target).backward()
        return {name: p.grad_sample for name, p in named}

    return hooks


# --- the models ---------------------------------------------------------------------------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(32, 10))


class EmbeddingClassifier(nn.Module):
    """Token embeddings (5,000 x 64), LayerNorm, the mean over the sequence, a linear head."""

    def __init__(self, vocabulary: int = 5000, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embedding(tokens)).mean(1))


class RecurrentClassifier(nn.Module):
    """opacus's DPLSTM (batch first), a linear head on the last step."""

    def __init__(self, features: int = 32, hidden: int = 64, classes: int = 4) -> None:
        super().__init__()
        from opacus.layers import DPLSTM

        self.lstm = DPLSTM(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, sequence: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(sequence)[0][:, -1])


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable rank-``rank`` update ``B A`` scaled by ``alpha / rank``."""

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # not the usual zeros: every adapter weight gets a gradient
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scale


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention (LoRA on the query and value projections) and a GELU feed-forward."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.query, self.value = LoRALinear(nn.Linear(width, width)), LoRALinear(nn.Linear(width, width))
        self.key, self.out = nn.Linear(width, width), nn.Linear(width, width)
        self.feedforward = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        n, length, width = x.shape
        return x.view(n, length, self.heads, width // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = self._split(self.query(h)), self._split(self.key(h)), self._split(self.value(h))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(x.shape))
        return x + self.feedforward(self.norm2(x))


class LoRADecoder(nn.Module):
    """A 2-block GPT-style decoder (vocabulary 512, width 64, 4 heads, 32 positions), frozen but for its adapters."""

    def __init__(self, vocabulary: int = 512, width: int = 64, heads: int = 4, length: int = 32,
                 blocks: int = 2) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocabulary, width), nn.Embedding(length, width)
        self.blocks = nn.ModuleList(DecoderBlock(width, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary, bias=False)
        for name, p in self.named_parameters():
            p.requires_grad_("lora_" in name)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[-1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# --- the workloads ------------------------------------------------------------------------------------------------


def _seeded(batch: int) -> torch.Generator:
    torch.manual_seed(0)
    return torch.Generator().manual_seed(batch)


def _mlp(batch: int) -> Setup:
    generator = _seeded(batch)
    x = torch.randn(batch, 128, generator=generator)
    return per_sample_setup(mlp(), (x,), torch.randint(0, 10, (batch,), generator=generator))


def _cnn(batch: int) -> Setup:
    generator = _seeded(batch)
    images = torch.randn(batch, 3, 32, 32, generator=generator)
    return per_sample_setup(cnn(), (images,), torch.randint(0, 10, (batch,), generator=generator))


def _embedding(batch: int) -> Setup:
    generator = _seeded(batch)
    tokens = torch.randint(0, 5000, (batch, 16), generator=generator)
    return per_sample_setup(EmbeddingClassifier(), (tokens,), torch.randint(0, 10, (batch,), generator=generator))


def _dplstm(batch: int) -> Setup:
    missing = opacus_missing()
    if missing is not None:
        raise ModuleNotFoundError(missing)
    generator = _seeded(batch)
    sequences = torch.randn(batch, 16, 32, generator=generator)
    return per_sample_setup(RecurrentClassifier(), (sequences,), torch.randint(0, 4, (batch,), generator=generator))


def _lora(batch: int) -> Setup:
    generator = _seeded(batch)
    tokens = torch.randint(0, 512, (batch, 33), generator=generator)
    model = LoRADecoder()
    # The adapters' gradients are small (the base is frozen): compared relative to their scale.
    return per_sample_setup(model, (tokens[:, :-1],), tokens[:, 1:], next_token_loss, rtol=1e-3,
                            atol=1e-6 * math.sqrt(batch))


WORKLOADS: list[Workload] = [
    Workload("mlp-128-256-256-10", "dp", _mlp),
    Workload("cnn-groupnorm", "dp", _cnn),
    Workload("embedding-layernorm-classifier", "dp", _embedding),
    Workload("dplstm-classifier", "dp", _dplstm),
    Workload("lora-decoder", "dp", _lora),
]
