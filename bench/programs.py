"""``python -m bench.programs [--rounds 7] [--only NAME ...]``: whole torch.func programs, natively and inside use().

Programs a user writes with torch.func over ``torch.nn`` layers, beside ``bench.models``' per-sample-gradient steps:
a physics-informed network's residual (jacrev of jacrev under vmap, then grad), MAML (grad of an inner grad step,
vmapped over tasks), an ensemble by ``stack_module_state``, a neural ODE's Jacobian through an RK4 solver, input
Hessians and Jacobians, per-sample gradients through attention with key padding, a decoder layer, CTC, distances
(``cdist``, ``pdist``), a bidirectional LSTM, losses, resampling, linear algebra, index writes and mean/max
aggregation in user code, an EmbeddingBag, a bilinear scorer with a multi-class hinge loss, an Elman RNN written
with ``nn.Linear`` in user code, and six that PyTorch's own transforms fail on (a GRU's jvp, an Elman RNN, an
unrolled LSTMCell and GRUCell, one-hot targets, and a ``transformers`` BERT over differently padded sequences, which
needs the ``models`` extra).

Each is built once (fixed weights and data), run natively (outside ``use()``) and inside ``registry.use()`` (an
empty store, policy auto); use()'s result is checked against native's first, or, where native fails, against the
per-sample loop, which is then what use() is timed against. One intra-op thread, thread CPU time, interleaved
rounds (the order swapped every round); a row reports each side's median and the median of the per-round ratios
native / use() (above 1: use() is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - PyTorch's own convention
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, stack_module_state, vmap
from torch.utils._pytree import tree_flatten  # noqa: PLC2701 - PyTorch's pytree

import registry

Program = Callable[[], Any]


@dataclass(frozen=True)
class Built:
    """A program ready to run, and where native fails, the per-sample loop its result must equal instead."""

    run: Program
    loop: Program | None = None


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in module.named_parameters()}


def mha_key_padding() -> Built:
    """Per-sample gradients of a multi-head attention layer with a key padding mask (batch 16, length 32)."""
    layer = nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(16, 32, 32)
    padding = torch.zeros(16, 32, dtype=torch.bool)
    padding[:, 24:] = True

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        out, _ = functional_call(layer, p, (x[None], x[None], x[None]), {"key_padding_mask": k[None],
                                                                          "need_weights": False})
        return out.pow(2).sum()

    return Built(lambda: vmap(grad(loss), in_dims=(None, 0, 0))(_params(layer), x, padding))


def decoder_layer() -> Built:
    """Per-sample gradients of a causal transformer decoder layer with cross-attention (batch 16)."""
    layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    x, memory = torch.randn(16, 12, 32), torch.randn(16, 10, 32)
    causal = nn.Transformer.generate_square_subsequent_mask(12)

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return functional_call(layer, p, (x[None], m[None]), {"tgt_mask": causal, "tgt_is_causal": True}).pow(2).sum()

    return Built(lambda: vmap(grad(loss), in_dims=(None, 0, 0))(_params(layer), x, memory))


def pinn_burgers() -> Built:
    """The gradient of a Burgers-equation residual loss at 256 collocation points (jacrev of jacrev under vmap)."""
    net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    points = torch.rand(256, 2)

    def u(p: dict[str, torch.Tensor], xt: torch.Tensor) -> torch.Tensor:
        return functional_call(net, p, (xt,)).squeeze(-1)

    def residual(p: dict[str, torch.Tensor], xt: torch.Tensor) -> torch.Tensor:
        du = jacrev(u, argnums=1)(p, xt)
        d2u = jacrev(jacrev(u, argnums=1), argnums=1)(p, xt)
        return du[1] + u(p, xt) * du[0] - 0.01 * d2u[0, 0]

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return vmap(residual, in_dims=(None, 0))(p, points).pow(2).mean()

    return Built(lambda: grad(loss)(_params(net)))


def maml() -> Built:
    """MAML's meta-gradient over 16 sine-regression tasks: grad of the loss after an inner grad step, per task."""
    net = nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1))
    support, query = torch.randn(16, 10, 1), torch.randn(16, 10, 1)
    support_y, query_y = torch.sin(support), torch.sin(query)

    def adapted(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        g = grad(lambda q: F.mse_loss(functional_call(net, q, (x,)), y))(p)
        return {k: p[k] - 0.01 * g[k] for k in p}

    def outer(p: dict[str, torch.Tensor], xs: torch.Tensor, ys: torch.Tensor, xq: torch.Tensor,
              yq: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(functional_call(net, adapted(p, xs, ys), (xq,)), yq)

    return Built(lambda: vmap(grad(outer), in_dims=(None, 0, 0, 0, 0))(_params(net), support, support_y, query,
                                                                         query_y))


def ensemble() -> Built:
    """Gradients of 8 models stacked by stack_module_state (LayerNorm, GELU, label smoothing), one batch of 64."""
    models = [nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 5)) for _ in range(8)]
    params, buffers = stack_module_state(models)
    base = models[0]
    x, y = torch.randn(64, 16), torch.randint(0, 5, (64,))

    def loss(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: torch.Tensor,
             y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(base, (p, b), (x,)), y, label_smoothing=0.1)

    return Built(lambda: vmap(grad(loss), in_dims=(0, 0, None, None))(params, buffers, x, y))


def neural_ode() -> Built:
    """Per-trajectory Jacobians of an RK4 solve (10 steps) of a learned vector field, 16 initial states."""
    field = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 4))
    starts = torch.randn(16, 4)

    def solve(p: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        h = 0.1
        for _ in range(10):
            k1 = functional_call(field, p, (y,))
            k2 = functional_call(field, p, (y + h / 2 * k1,))
            k3 = functional_call(field, p, (y + h / 2 * k2,))
            k4 = functional_call(field, p, (y + h * k3,))
            y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return y

    return Built(lambda: vmap(jacrev(solve, argnums=1), in_dims=(None, 0))(_params(field), starts))


def input_hessians() -> Built:
    """Hessians of an energy network with respect to its 8-d input, 32 inputs."""
    net = nn.Sequential(nn.Linear(8, 64), nn.Softplus(), nn.Linear(64, 1))
    x = torch.randn(32, 8)
    return Built(lambda: vmap(hessian(lambda s: net(s).sum()))(x))


def conv_jacobians() -> Built:
    """Forward-mode input Jacobians of a small CNN (GroupNorm, SiLU, adaptive pooling), 8 images."""
    net = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.AdaptiveAvgPool2d(2),
                        nn.Flatten(), nn.Linear(32, 3))
    x = torch.randn(8, 2, 8, 8)
    return Built(lambda: vmap(jacfwd(lambda s: net(s[None])[0]))(x))


def _per_sample(model: nn.Module, loss_fn: Callable[..., torch.Tensor], *data: torch.Tensor) -> Program:
    params, buffers = _params(model), dict(model.named_buffers())

    def loss(p: dict[str, torch.Tensor], *d: torch.Tensor) -> torch.Tensor:
        batch = [t.unsqueeze(0) for t in d]
        return loss_fn(functional_call(model, (p, buffers), (batch[0],)), *batch[1:])

    return lambda: vmap(grad(loss), in_dims=(None,) + (0,) * len(data))(params, *data)


def embedding_padding_idx() -> Built:
    """Per-sample gradients of a bag-of-tokens classifier whose embedding has a padding index (batch 64)."""
    model = nn.Sequential(nn.Embedding(500, 16, padding_idx=0), nn.Flatten(), nn.Linear(16 * 8, 4))
    ids = torch.randint(0, 500, (64, 8))
    ids[:, -2:] = 0
    return Built(_per_sample(model, F.cross_entropy, ids, torch.randint(0, 4, (64,))))


def ctc_per_sample() -> Built:
    """Per-sample gradients of a CTC loss over a linear acoustic head (batch 16, 50 frames, 8 labels)."""
    head = nn.Linear(16, 12)
    frames, targets = torch.randn(16, 50, 16), torch.randint(1, 12, (16, 8))

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        log_probs = functional_call(head, p, (x,)).log_softmax(-1).unsqueeze(1)
        return F.ctc_loss(log_probs, t[None], torch.tensor([50]), torch.tensor([8]))

    return Built(lambda: vmap(grad(loss), in_dims=(None, 0, 0))(_params(head), frames, targets))


def linear_algebra() -> Built:
    """Per-problem gradients through solve, Cholesky and eigvalsh of 5 x 5 systems (64 problems)."""
    systems = torch.randn(64, 5, 5) + 5 * torch.eye(5)
    rhs, w = torch.randn(64, 5), torch.randn(5)

    def loss(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        solution = torch.linalg.solve(a + torch.diag(w.exp()), b)
        factor = torch.linalg.cholesky(a @ a.T + torch.eye(5))
        return solution.pow(2).sum() + factor.diagonal().log().sum() + torch.linalg.eigvalsh(a + a.T).max()

    return Built(lambda: vmap(grad(loss), in_dims=(None, 0, 0))(w, systems, rhs))


def gru_jvp() -> Built:
    """Forward-mode directional derivatives through a GRU, per sequence (8 sequences): PyTorch's own fails here."""
    gru = nn.GRU(4, 16, batch_first=True)
    x, tangent = torch.randn(8, 10, 4), torch.randn(8, 10, 4)

    def derivative(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return jvp(lambda v: gru(v[None])[0].sum(), (s,), (t,))[1]

    return Built(lambda: vmap(derivative)(x, tangent),
                 loop=lambda: torch.stack([derivative(s, t) for s, t in zip(x, tangent, strict=True)]))


def resampling() -> Built:
    """Per-sample gradients through bilinear upsampling, affine_grid and grid_sample (16 images)."""
    images = torch.randn(16, 3, 8, 8)
    theta = torch.randn(16, 2, 3) * 0.1 + torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])

    def loss(x: torch.Tensor, th: torch.Tensor) -> torch.Tensor:
        up = F.interpolate(x[None], scale_factor=2, mode="bilinear", align_corners=False)
        grid = F.affine_grid(th[None], [1, 3, 16, 16], align_corners=False)
        return F.grid_sample(up, grid, align_corners=False).pow(2).sum()

    return Built(lambda: vmap(grad(loss, argnums=(0, 1)))(images, theta))


def sorting_and_scans() -> Built:
    """Per-sample gradients through cumsum, cumprod, sort, topk, logcumsumexp and diff (64 samples of 20 x 16)."""
    x = torch.randn(64, 20, 16)

    def loss(s: torch.Tensor) -> torch.Tensor:
        return (s.cumsum(0).sum() + s.cumprod(0)[:5].sum() + s.sort().values[:3].sum() + s.topk(4).values.sum()
                + torch.logcumsumexp(s, 0).sum() + s.diff().abs().sum())

    return Built(lambda: vmap(grad(loss))(x))


def point_distances() -> Built:
    """Per-cloud gradients of a chamfer-style loss (cdist) and pairwise spread (pdist), 16 clouds of 64 points."""
    clouds, targets = torch.randn(16, 64, 3), torch.randn(16, 48, 3)

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cdist(x, y).min(-1).values.mean() - 0.01 * F.pdist(x).mean()

    return Built(lambda: vmap(grad(loss, argnums=(0, 1)))(clouds, targets))


def graph_scatter() -> Built:
    """Per-sample gradients of mean aggregation written with index_add_, scatter_add_ and a masked write."""
    x, index = torch.randn(32, 40, 8), torch.randint(0, 6, (40,))

    def loss(s: torch.Tensor) -> torch.Tensor:
        summed = s.new_zeros(6, 8).index_add_(0, index, s)
        counts = torch.zeros(6).scatter_add_(0, index, torch.ones(40))
        copy = torch.empty_like(s)
        copy.copy_(s)
        copy[index == 0] = 0.0
        return (summed / counts.clamp(min=1)[:, None]).pow(2).sum() + copy.sum()

    return Built(lambda: vmap(grad(loss))(x))


def bidirectional_lstm() -> Built:
    """Per-sample gradients of a 2-layer bidirectional LSTM (batch 16, 12 steps)."""
    lstm = nn.LSTM(8, 16, batch_first=True, num_layers=2, bidirectional=True)
    x = torch.randn(16, 12, 8)

    def loss(p: dict[str, torch.Tensor], s: torch.Tensor) -> torch.Tensor:
        out, (h, _) = functional_call(lstm, p, (s[None],))
        return out.pow(2).mean() + h.sum()

    return Built(lambda: vmap(grad(loss), in_dims=(None, 0))(_params(lstm), x))


def batchnorm_eval() -> Built:
    """Per-sample gradients of a CNN with BatchNorm in eval mode (batch 64)."""
    model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 10)).train(False)
    return Built(_per_sample(model, F.cross_entropy, torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))))


def conv1d_autoencoder() -> Built:
    """Per-sample gradients of a strided Conv1d / ConvTranspose1d autoencoder (batch 64)."""
    model = nn.Sequential(nn.Conv1d(3, 8, 3, stride=2), nn.ReLU(), nn.ConvTranspose1d(8, 3, 3, stride=2))
    x = torch.randn(64, 3, 31)
    return Built(_per_sample(model, lambda out, target: F.mse_loss(out, target[..., :out.shape[-1]]), x, x))


def losses() -> Built:
    """Per-sample gradients of KL divergence, Huber, smooth L1 and BCE-with-logits over a linear head (batch 64)."""
    head = nn.Linear(16, 8)
    x, target = torch.randn(64, 16), torch.softmax(torch.randn(64, 8), -1)

    def loss_fn(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (F.kl_div(out.log_softmax(-1), t, reduction="batchmean") + F.huber_loss(out, t)
                + F.smooth_l1_loss(out, t) + F.binary_cross_entropy_with_logits(out, t))

    return Built(_per_sample(head, loss_fn, x, target))


def _loop_grads(loss: Callable[..., torch.Tensor], params: dict[str, torch.Tensor], *batch: torch.Tensor
                ) -> Program:
    """The per-sample loop of ``grad(loss)``: one call per sample, outside vmap."""
    def run() -> dict[str, torch.Tensor]:
        grads = [grad(loss)(params, *sample) for sample in zip(*batch, strict=True)]
        return {name: torch.stack([g[name] for g in grads]) for name in params}
    return run


def rnn_tanh() -> Built:
    """Per-sample gradients of an Elman RNN (batch 16, 12 steps): PyTorch's own fails under vmap(grad)."""
    rnn = nn.RNN(8, 32, batch_first=True)
    x, params = torch.randn(16, 12, 8), _params(rnn)

    def loss(p: dict[str, torch.Tensor], s: torch.Tensor) -> torch.Tensor:
        return functional_call(rnn, p, (s[None],))[0].pow(2).sum()

    return Built(lambda: vmap(grad(loss), in_dims=(None, 0))(params, x), loop=_loop_grads(loss, params, x))


def lstm_cell_loop() -> Built:
    """Per-sample gradients of a hand-unrolled LSTMCell (batch 16, 10 steps): PyTorch's own fails under vmap(grad)."""
    cell = nn.LSTMCell(8, 32)
    x, params = torch.randn(16, 10, 8), _params(cell)

    def loss(p: dict[str, torch.Tensor], s: torch.Tensor) -> torch.Tensor:
        h, c = torch.zeros(1, 32), torch.zeros(1, 32)
        for t in range(s.shape[0]):
            h, c = functional_call(cell, p, (s[t][None], (h, c)))
        return h.pow(2).sum()

    return Built(lambda: vmap(grad(loss), in_dims=(None, 0))(params, x), loop=_loop_grads(loss, params, x))


def gru_cell_loop() -> Built:
    """Per-sample gradients of a hand-unrolled GRUCell (batch 16, 10 steps) from a shared zero state: PyTorch's own
    fails under vmap(grad)."""
    cell = nn.GRUCell(8, 32)
    x, params = torch.randn(16, 10, 8), _params(cell)

    def loss(p: dict[str, torch.Tensor], s: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(1, 32)
        for t in range(s.shape[0]):
            h = functional_call(cell, p, (s[t][None], h))
        return h.pow(2).sum()

    return Built(lambda: vmap(grad(loss), in_dims=(None, 0))(params, x), loop=_loop_grads(loss, params, x))


def one_hot_targets() -> Built:
    """Per-sample gradients of a loss written with F.one_hot targets (batch 64): PyTorch's own fails under vmap."""
    head = nn.Linear(16, 10)
    x, y, params = torch.randn(64, 16), torch.randint(0, 10, (64,)), _params(head)

    def loss(p: dict[str, torch.Tensor], s: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        log_probs = functional_call(head, p, (s,)).log_softmax(-1)
        return -(F.one_hot(label, 10).to(log_probs.dtype) * log_probs).sum()

    return Built(lambda: vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y), loop=_loop_grads(loss, params, x, y))


def bilinear_hinge() -> Built:
    """Per-sample gradients of a bilinear scorer trained with a multi-class hinge loss (batch 16, 32 features, 10
    classes): nn.Bilinear and F.multi_margin_loss both loop under vmap natively."""
    scorer = nn.Bilinear(32, 32, 10)
    x, context, y, params = torch.randn(16, 32), torch.randn(16, 32), torch.randint(0, 10, (16,)), _params(scorer)

    def loss(p: dict[str, torch.Tensor], s: torch.Tensor, c: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return F.multi_margin_loss(functional_call(scorer, p, (s[None], c[None])), label[None])

    return Built(lambda: vmap(grad(loss), in_dims=(None, 0, 0, 0))(params, x, context, y))


class _LinearRecurrence(nn.Module):
    """An Elman RNN written with two nn.Linear layers applied at every step (as opacus's DPLSTM writes its gates),
    and a linear head on the last state."""

    def __init__(self, features: int = 16, hidden: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.input, self.hidden, self.head = nn.Linear(features, hidden), nn.Linear(hidden, hidden), nn.Linear(
            hidden, classes)

    def forward(self, sequence: torch.Tensor) -> torch.Tensor:
        state = sequence.new_zeros(sequence.shape[0], self.hidden.out_features)
        for step in sequence.unbind(1):
            state = torch.tanh(self.input(step) + self.hidden(state))
        return self.head(state)


def linear_recurrence() -> Built:
    """Per-sample gradients of an Elman RNN written with nn.Linear in user code (batch 32, 24 steps, hidden 64): each
    weight used at every step."""
    model = _LinearRecurrence()
    x, y, params = torch.randn(32, 24, 16), torch.randint(0, 4, (32,)), _params(model)

    def loss(p: dict[str, torch.Tensor], s: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, p, (s[None],)), label[None])

    return Built(lambda: vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y))


def graph_mean_max() -> Built:
    """Per-graph gradients of mean and max neighbour aggregation (index_reduce, scatter_reduce), 32 graphs."""
    x, index = torch.randn(32, 60, 16), torch.randint(0, 12, (60,))

    def loss(s: torch.Tensor) -> torch.Tensor:
        mean = torch.zeros(12, 16).index_reduce(0, index, s, "mean", include_self=False)
        top = torch.zeros(12, 16).scatter_reduce(0, index[:, None].expand(-1, 16), s, "amax", include_self=False)
        return (mean * top).sum()

    return Built(lambda: vmap(grad(loss))(x))


def embedding_bag() -> Built:
    """Per-sample gradients of an EmbeddingBag with per-sample weights (batch 64, bags of 8)."""
    bag = nn.EmbeddingBag(1000, 16, mode="sum")
    ids, weights, params = torch.randint(0, 1000, (64, 8)), torch.rand(64, 8), _params(bag)

    def loss(p: dict[str, torch.Tensor], i: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return functional_call(bag, p, (i[None],), {"per_sample_weights": w[None]}).pow(2).sum()

    return Built(lambda: vmap(grad(loss), in_dims=(None, 0, 0))(params, ids, weights))


def bert_padded() -> Built:
    """Per-sample gradients of a tiny BERT classifier (the ``transformers`` library, random weights) over a batch of
    16 sequences of 16 tokens padded differently: PyTorch's own fails (the library asks ``padding_mask.all()``)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from a config: nothing is fetched
    import transformers

    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=3)
    model = transformers.BertForSequenceClassification(config).train(False)
    ids, labels = torch.randint(0, 100, (16, 16)), torch.randint(0, 3, (16,))
    mask = (torch.arange(16) < torch.randint(4, 17, (16, 1))).long()
    params = _params(model)

    def loss(p: dict[str, torch.Tensor], i: torch.Tensor, m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (), {"input_ids": i[None], "attention_mask": m[None],
                                              "labels": y[None]}).loss

    return Built(lambda: vmap(grad(loss), in_dims=(None, 0, 0, 0))(params, ids, mask, labels),
                 loop=_loop_grads(loss, params, ids, mask, labels))


PROGRAMS: dict[str, Callable[[], Built]] = {fn.__name__.replace("_", "-"): fn for fn in (
    mha_key_padding, decoder_layer, pinn_burgers, maml, ensemble, neural_ode, input_hessians, conv_jacobians,
    embedding_padding_idx, ctc_per_sample, linear_algebra, gru_jvp, resampling, sorting_and_scans, point_distances,
    graph_scatter, bidirectional_lstm, batchnorm_eval, conv1d_autoencoder, losses, rnn_tanh, lstm_cell_loop,
    gru_cell_loop, one_hot_targets, graph_mean_max, embedding_bag, bert_padded, bilinear_hinge, linear_recurrence)}


def build(name: str) -> Built:
    """The program ``name``, its weights and data drawn from a fixed seed."""
    torch.manual_seed(0)
    return PROGRAMS[name]()


def leaves(result: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]


def same(got: Any, expected: Any) -> bool:
    a, b = leaves(got), leaves(expected)
    return len(a) == len(b) and all(x.shape == y.shape and torch.allclose(x, y, rtol=1e-4, atol=1e-5)
                                    for x, y in zip(a, b, strict=True))


def _timed(program: Program, inside: bool) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's performance warnings, natively
        if inside:
            with registry.use():
                start = time.thread_time()
                program()
                return time.thread_time() - start
        start = time.thread_time()
        program()
        return time.thread_time() - start


def measure(name: str, rounds: int) -> dict[str, Any]:
    built = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            expected = built.run()
            native_fails = False
        except Exception:  # PyTorch's own failure is this program's native result
            if built.loop is None:
                raise
            expected, native_fails = built.loop(), True
        with registry.use():
            got = built.run()
    row: dict[str, Any] = {"program": name, "equal": same(got, expected), "native_fails": native_fails}
    # Where native fails, use() is timed against the per-sample loop, the user's other way to compute it.
    baseline = built.loop if native_fails and built.loop is not None else built.run
    base_s, use_s, ratios = [], [], []
    for index in range(rounds):
        order = (False, True) if index % 2 == 0 else (True, False)
        timings = {inside: _timed(built.run if inside else baseline, inside) for inside in order}
        base_s.append(timings[False])
        use_s.append(timings[True])
        ratios.append(timings[False] / timings[True])
    row.update(native_ms=statistics.median(base_s) * 1e3, use_ms=statistics.median(use_s) * 1e3,
               ratio=statistics.median(ratios))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.programs", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", nargs="+", choices=sorted(PROGRAMS), help="these programs only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as store:  # a new user's empty store
        os.environ["MULTICOMPOSITE_DB"] = f"sqlite:///{store}/empty.db"
        print(f"{'program':24s} {'native ms':>10s} {'use() ms':>10s} {'native/use':>11s}  equal")
        worst = None
        for name in args.only or list(PROGRAMS):
            try:
                row = measure(name, args.rounds)
            except ModuleNotFoundError as missing:  # a program over an optional library
                print(f"{name:24s} skipped: it needs {missing.name} (pip install 'multicomposite[models]')")
                continue
            if row["native_fails"]:
                print(f"{name:24s} {'fails':>10s} {row['use_ms']:10.2f} {'-':>11s}  {row['equal']} (the loop's "
                      f"gradients; the loop {row['native_ms']:.2f} ms, {row['ratio']:.2f}x use()'s time)", flush=True)
                continue
            worst = row["ratio"] if worst is None else min(worst, row["ratio"])
            print(f"{name:24s} {row['native_ms']:10.2f} {row['use_ms']:10.2f} {row['ratio']:10.2f}x  {row['equal']}",
                  flush=True)
        if worst is not None:
            print(f"lowest native/use(): {worst:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
