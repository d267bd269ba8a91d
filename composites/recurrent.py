"""Composites of the recurrent family: ``rnn_tanh``, ``rnn_relu``, ``lstm`` and ``gru`` as batched cells over time.

PyTorch's own recurrent ops fail under vmap (measured on torch 2.13.0 CPU, through ``nn.RNN``, ``nn.GRU`` and
``nn.LSTM``): ``vmap`` raises "Batching rule not implemented for aten::gru.input. We could not generate a fallback."
(the same for ``rnn_tanh``, ``rnn_relu``, ``lstm`` and their ``.data`` overloads); under ``vmap(grad)`` the GRU and
RNN decompositions raise a shape error inside an in-place ``add_``, and the LSTM runs vmap's per-sample loop over
``aten::mkldnn_rnn_layer``. Under ``grad`` alone and ``jacrev`` (whose forward runs under grad only) they work.

The ``unrolled`` composite computes what PyTorch's CPU kernel computes, with out-of-place ops only: per layer and
direction, one matrix product projects the whole input sequence, then a Python loop over the time steps applies
the cell (one matrix product with the hidden state and elementwise gates), in PyTorch's gate order and formulas.
Every op it calls has a batching rule, so under vmap the cells run batched over the vmap dimension too. Dropout
between layers (``dropout > 0`` in training) calls ``torch.dropout`` on each layer's output, as PyTorch's kernel
does: outside vmap it draws the same numbers as PyTorch's op, and under vmap it follows vmap's ``randomness``
(``"error"``, the default, raises vmap's own error; ``"different"`` and ``"same"`` run).

Under vmap(grad) the LSTM's and the GRU's ``recurrence`` primitives run instead (each layer and direction; the
LSTM's without a projection): the recurrence over time is one ``torch.autograd.Function`` whose vmap rule runs it on
the whole physical batch and whose backward (BPTT on plain tensors) forms each sample's hidden-weight (and GRU
hidden-bias) gradient once, as one product over the time steps; unrolled, every step adds a per-sample outer product
of B x 4H x H to the one before (measured on the bench.models LSTM classifier at batch 64: 43 ms a step against 11
ms). It has no forward AD and no second derivative: under jvp, jacfwd and hessian the unrolled cells run. Where the
C++ build is loaded, only vmap and grad levels are active and the hidden weight is the same for every sample, the
recurrence runs as ``multicomposite::lstm_recurrence`` / ``gru_recurrence`` instead: the same steps and backward as
ops with a C++ autograd node and batching rules (``registry/core/kernels/recurrence.cpp``, NOTE [recurrence ops]).

Packed sequences (``.data`` overloads, ``nn.GRU(PackedSequence)``) are routed under vmap to ``unrolled_packed``,
registered as a companion overload of the op (``register_derivative``): PyTorch's kernel everywhere else. Packing
itself must happen outside vmap (``pack_padded_sequence`` under vmap loops and batches ``batch_sizes``, whose
``.item()`` then fails inside ``nn.GRU``); with the packed ``data`` batched and ``batch_sizes`` shared, the
composite runs each time step on the sequences still active at it, as PyTorch's packed kernel does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import torch
from torch.autograd import Function

from composites import linear as linear_maps
from registry.core import rules
from registry.core.context import functorch_stack, innermost, vmap_levels
from registry.core.ops import overloads
from registry.core.primitive import apply, batch_first
from registry.core.registration import define_op, register, register_derivative

# One cell step: (precomputed input projection at t, hidden state, cell state or None, the layer's hidden weights)
# -> (new hidden state, new cell state or None).
Cell = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]

_GATES = {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3}


def _native_rules(op: str) -> rules.Rule:
    """Where PyTorch's own ``op`` fails (measured on the aten ops and through nn.RNN, nn.GRU and nn.LSTM, torch 2.13.0
    CPU). The flat parameter list is a Tensor[]: the router sees ``input`` and ``hx`` only (and for the LSTM, whose
    ``hx`` is a Tensor[] too, ``input`` only)."""
    no_rule = rules.fails_when(
        rules.innermost_vmap, "error",
        f"Batching rule not implemented for aten::{op}.input (vmap raises: we could not generate a fallback)")
    if op == "lstm":
        return rules.first_of(no_rule, rules.fails_when(
            rules.under_vmap, "error",
            "under vmap(grad) aten::lstm.input raises a shape error inside its in-place cell updates, or (nn.LSTM "
            "on CPU) loops over aten::mkldnn_rnn_layer, which has no batching rule; under vmap(jvp) and jacfwd "
            "mkldnn_rnn_layer has no forward AD; the state pair hx, a Tensor[], is not visible to the router, so "
            "every vmap takes the composite"))

    def shape_error(ctx) -> bool:
        if not rules.under_vmap(ctx):
            return False
        # Only the innermost level's batching is known: nested vmaps and compiled graphs are assumed batched.
        return "compile" in ctx.stack or ctx.stack.count("vmap") > 1 or bool({"input", "hx"} & set(ctx.batched))

    return rules.first_of(no_rule, rules.fails_when(
        shape_error, "error",
        f"aten::{op}.input decomposes into in-place cell updates that raise a shape error under vmap(grad) and "
        "vmap(jvp) where input or hx is batched (output with shape [N, H] doesn't match the broadcast shape "
        "[B, N, H]); with only the parameters batched, and under jacfwd, it works"))


def _first_order_only(ctx: rules.Context) -> bool:
    """Forward AD, or a derivative of a derivative: the recurrence primitive has neither (jvp, jacfwd, hessian,
    grad of grad)."""
    return "jvp" in ctx.stack or ctx.stack.count("grad") + ctx.stack.count("autograd") > 1


def _recurrence_first(ctx: rules.Context) -> rules.Order | None:
    """Under vmap with a gradient taken: the recurrence primitive (LSTM, GRU), whose backward forms each sample's
    hidden-weight gradient as one product over the time steps (the unrolled cells accumulate one outer product per
    step); PyTorch's own op first wherever it works."""
    if rules.under_vmap(ctx) and ("grad" in ctx.stack or "autograd" in ctx.stack) and not _first_order_only(ctx):
        return rules.Order(("native", "primitive", "functional", "mutating"),
                           "under vmap(grad) the recurrence primitive forms each sample's hidden-weight gradient "
                           "once, as one product over the time steps, where the unrolled cells add one per step")
    return None


_RECURRENCE_RULE = rules.fails_when(_first_order_only, "error", "the recurrence primitive has a first derivative "
                                   "only (no forward AD, no derivative of its backward)")

for _op, _doc in (
    ("rnn_tanh", "an Elman RNN with tanh: h' = tanh(W_ih x + b_ih + W_hh h + b_hh), over layers and directions"),
    ("rnn_relu", "an Elman RNN with relu: h' = relu(W_ih x + b_ih + W_hh h + b_hh), over layers and directions"),
):
    define_op(_op, "input", tensors=("input", "hx"), doc=_doc, inplace=False,
              overloads=overloads(_op, inplace=False, only=(f"{_op}.input",)), rules={"native": _native_rules(_op)})
define_op("gru", "input", tensors=("input", "hx"), doc="a gated recurrent unit (gates r, z, n), over layers and "
          "directions", inplace=False, overloads=overloads("gru", inplace=False, only=("gru.input",)),
          rules={"native": _native_rules("gru"), "primitive": _RECURRENCE_RULE}, preference=_recurrence_first)
define_op("lstm", "input", tensors=("input",), doc="a long short-term memory (gates i, f, g, o; optional projection), "
          "over layers and directions; hx is the pair (h0, c0)", inplace=False,
          overloads=overloads("lstm", inplace=False, only=("lstm.input",)),
          rules={"native": _native_rules("lstm"), "primitive": _RECURRENCE_RULE},
          preference=_recurrence_first)


# --- cells: PyTorch's formulas (aten/src/ATen/native/RNN.cpp), out of place ----------------------------------------


# A cell stepped T times (a user's loop, or the unrolled layers) uses its hidden weight T times: linear's C++ op
# forms the T per-sample gradients once over the steps, where autograd would sum them out of place.
_linear = linear_maps.linear


def _elman(activation: Callable[[torch.Tensor], torch.Tensor]) -> Cell:
    def cell(x_t, h, c, w_hh, b_hh, w_hr):
        return activation(x_t + _linear(h, w_hh, b_hh)), None

    return cell


def _gru_cell(x_t, h, c, w_hh, b_hh, w_hr):
    # r and z in one sigmoid over the first two gate blocks (PyTorch computes the same two sums separately).
    gates = h.shape[-1] * 2
    h_w = _linear(h, w_hh, b_hh)
    reset, update = torch.sigmoid(x_t[..., :gates] + h_w[..., :gates]).chunk(2, -1)
    new = torch.tanh(x_t[..., gates:] + reset * h_w[..., gates:])
    return (h - new) * update + new, None


def _lstm_cell(x_t, h, c, w_hh, b_hh, w_hr):
    # One sigmoid over all four gate blocks (g's is unused): fewer op calls per step, each batched.
    hidden = c.shape[-1]
    gates = x_t + _linear(h, w_hh, b_hh)
    i, f, _, o = torch.sigmoid(gates).chunk(4, -1)
    c = f * c + i * torch.tanh(gates[..., 2 * hidden:3 * hidden])
    h = o * torch.tanh(c)
    if w_hr is not None:
        h = _linear(h, w_hr, None)
    return h, c


_CELLS: dict[str, Cell] = {"rnn_tanh": _elman(torch.tanh), "rnn_relu": _elman(torch.relu), "gru": _gru_cell,
                           "lstm": _lstm_cell}


# --- the cell ops (nn.RNNCell, nn.GRUCell): one step, out of place -------------------------------------------------


def _hidden_not_batched(ctx: rules.Context) -> bool:
    """hx is shared by the samples (not batched at the innermost vmap level) while the input or a weight is: PyTorch's
    cell kernels add the input's gates into ``linear_hh(hx)`` in place (RNN.cpp), a batched value written into an
    unbatched one, which vmap refuses. It is the first step of any per-sample loop over a cell that starts from
    ``torch.zeros(1, hidden)``. lstm_cell's context holds h (the first tensor of ``hx = [h, c]``) as ``hx``."""
    return rules.under_vmap(ctx) and "hx" not in ctx.batched and bool(ctx.batched)


def _not_decomposed(op: str, status: str) -> rules.Rule:
    """Where vmap is the innermost transform the cell op reaches vmap's Batched key whole (it is decomposed at the
    Autograd key, so under vmap(grad) and vmap(jvp) its parts batch), and it has no batching rule there."""
    if status == "slow":
        # NOTE: a loop over one sample is one call of PyTorch's kernel: measured under vmap at batch 1, gru_cell
        # 94-130 us natively against 160-169 us for the composite; from batch 4 on the composite is 1.3x-6.9x faster.
        return rules.fails_when(lambda ctx: rules.innermost_vmap(ctx) and ctx.batch_size > 1, status,
                                f"aten::{op} has no batching rule, so where vmap is the innermost transform (the op "
                                "is not decomposed there) vmap runs a per-sample loop")
    return rules.fails_when(rules.innermost_vmap, status, f"aten::{op} has no batching rule, so where vmap is the "
                            "innermost transform (the op is not decomposed there) vmap raises (\"We could not "
                            "generate a fallback\": its hx is a Tensor[])")


for _op, _doc in (
    ("rnn_tanh_cell", "one Elman step with tanh: h' = tanh(W_ih x + b_ih + W_hh h + b_hh)"),
    ("rnn_relu_cell", "one Elman step with relu: h' = relu(W_ih x + b_ih + W_hh h + b_hh)"),
    ("gru_cell", "one GRU step (gates r, z, n): h' = (h - n) * z + n"),
):
    define_op(_op, "", tensors=("input", "hx", "w_ih", "w_hh", "b_ih", "b_hh"), doc=_doc, inplace=False,
              rules={"native": rules.first_of(_not_decomposed(_op, "slow"), rules.fails_when(
                  _hidden_not_batched, "error",
                  f"aten::{_op} adds the input's gates into linear_hh(hx) in place, which vmap refuses where hx is "
                  "shared by the samples and the input is not (\"output with shape [1, hidden] doesn't match the "
                  "broadcast shape\")"))})

define_op("lstm_cell", "", tensors=("input", "hx", "w_ih", "w_hh", "b_ih", "b_hh"),
          doc="one LSTM step (gates i, f, g, o): c' = f * c + i * g, h' = o * tanh(c'); hx is the pair [h, c]",
          inplace=False,
          rules={"native": rules.first_of(_not_decomposed("lstm_cell", "error"), rules.fails_when(
              _hidden_not_batched, "error",
              "aten::lstm_cell adds the input's gates into linear_hh(h) in place, which vmap refuses where h is shared "
              "by the samples and the input is not (\"output with shape [1, 4 * hidden] doesn't match the broadcast "
              "shape\")"))})


def _cell_step(kind: str, input, hx, w_ih, w_hh, b_ih, b_hh) -> torch.Tensor:
    h, _ = _CELLS[kind](_linear(input, w_ih, b_ih), hx, None, w_hh, b_hh, None)
    return h


@register("rnn_tanh_cell", "functional")
def rnn_tanh_cell_functional(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """PyTorch's formula out of place: the input's and the hidden state's linear maps added, then tanh."""
    return _cell_step("rnn_tanh", input, hx, w_ih, w_hh, b_ih, b_hh)


@register("rnn_relu_cell", "functional")
def rnn_relu_cell_functional(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """PyTorch's formula out of place: the input's and the hidden state's linear maps added, then relu."""
    return _cell_step("rnn_relu", input, hx, w_ih, w_hh, b_ih, b_hh)


@register("gru_cell", "functional")
def gru_cell_functional(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """PyTorch's GRU step out of place (the gate blocks r, z, n of the input's and the hidden state's linear maps)."""
    return _cell_step("gru", input, hx, w_ih, w_hh, b_ih, b_hh)


@register("lstm_cell", "functional")
def lstm_cell_functional(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """PyTorch's LSTM step out of place (the gate blocks i, f, g, o of the input's and the hidden state's linear
    maps); returns (h', c')."""
    if len(hx) != 2:
        raise RuntimeError("lstm_cell expects two hidden states")  # PyTorch's own message
    h, c = hx
    return _lstm_cell(_linear(input, w_ih, b_ih), h, c, w_hh, b_hh, None)


# --- the layout of PyTorch's flat parameter list --------------------------------------------------------------------


def _layer_params(op: str, params: Sequence[torch.Tensor], has_biases: bool, num_layers: int, bidirectional: bool,
                  ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                  torch.Tensor | None]]:
    """(w_ih, w_hh, b_ih, b_hh, w_hr) per layer and direction, in PyTorch's order (layer-major, forward first).

    Each group is ``w_ih, w_hh[, b_ih, b_hh][, w_hr]``; ``w_hr`` (LSTM's projection, ``proj_size > 0``) makes the
    group one longer."""
    directions = 2 if bidirectional else 1
    groups = num_layers * directions
    base = 4 if has_biases else 2
    if groups <= 0 or len(params) % groups or len(params) // groups not in (base, base + (op == "lstm")):
        raise ValueError(
            f"{op}: got {len(params)} parameter tensors for {num_layers} layer(s), "
            f"{'bidirectional' if bidirectional else 'one direction'}, has_biases={has_biases}: expected "
            f"{base * groups}{f' (or {(base + 1) * groups} with a projection)' if op == 'lstm' else ''}, "
            "as nn.RNN, nn.GRU and nn.LSTM pass their _flat_weights")
    size = len(params) // groups
    found = []
    for g in range(groups):
        group = list(params[g * size:(g + 1) * size])
        w_ih, w_hh = group[0], group[1]
        b_ih, b_hh = (group[2], group[3]) if has_biases else (None, None)
        w_hr = group[-1] if size == base + 1 else None
        if w_ih.shape[0] != w_hh.shape[0] or w_hh.shape[0] % _GATES[op]:
            raise ValueError(f"{op}: weight_ih and weight_hh of layer group {g} have {w_ih.shape[0]} and "
                             f"{w_hh.shape[0]} rows, expected the same multiple of {_GATES[op]} (gates x hidden size)")
        found.append((w_ih, w_hh, b_ih, b_hh, w_hr))
    return found


def _initial_states(op: str, hx: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    if op != "lstm":
        if not isinstance(hx, torch.Tensor):
            raise TypeError(f"{op}: hx must be one tensor (num_layers * directions, batch, hidden_size)")
        return hx, None
    if isinstance(hx, torch.Tensor) or len(hx) != 2:
        raise TypeError("lstm: hx must be the pair [h0, c0], each (num_layers * directions, batch, size)")
    return hx[0], hx[1]


def _project(op: str, layer_input: torch.Tensor, w_ih: torch.Tensor, b_ih: torch.Tensor | None,
             b_hh: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The input projection of a whole sequence, and the hidden bias the cell still adds per step: one product for
    every step, as PyTorch's CPU kernel does (pre_compute_input). Outside the GRU, whose new gate multiplies the
    hidden bias by the reset gate, the hidden bias is added here once rather than at every step."""
    projected = _linear(layer_input, w_ih, b_ih)
    if op == "gru" or b_hh is None:
        return projected, b_hh
    return projected + b_hh, None


# --- over time, layers and directions -------------------------------------------------------------------------------


def _run_direction(cell: Cell, projected: list[torch.Tensor], h: torch.Tensor, c: torch.Tensor | None,
                   w_hh: torch.Tensor, b_hh: torch.Tensor | None, w_hr: torch.Tensor | None, reverse: bool,
                   ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
    steps = range(len(projected) - 1, -1, -1) if reverse else range(len(projected))
    outputs: list[torch.Tensor] = [None] * len(projected)  # type: ignore[list-item]
    for t in steps:
        h, c = cell(projected[t], h, c, w_hh, b_hh, w_hr)
        outputs[t] = h
    return outputs, h, c


def _unrolled(op: str, input: torch.Tensor, hx, params, has_biases: bool, num_layers: int, dropout: float,
              train: bool, bidirectional: bool, batch_first: bool, fused: bool = False):
    if input.dim() != 3:
        raise ValueError(f"{op}: input must be 3-D ({'batch, seq' if batch_first else 'seq, batch'}, features), got "
                         f"shape {tuple(input.shape)}; nn.RNN, nn.GRU and nn.LSTM add the batch dimension of an "
                         "unbatched input before calling it")
    if input.shape[1 if batch_first else 0] == 0:
        raise RuntimeError("Expected sequence length to be larger than 0 in RNN")  # PyTorch's own, word for word
    cell = _CELLS[op]
    h0, c0 = _initial_states(op, hx)
    directions = 2 if bidirectional else 1
    layers = _layer_params(op, params, has_biases, num_layers, bidirectional)
    layer_input = input.transpose(0, 1) if batch_first else input
    h_n, c_n = [], []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            w_ih, w_hh, b_ih, b_hh, w_hr = layers[index]
            projected, step_bias = _project(op, layer_input, w_ih, b_ih, b_hh)
            if fused and op == "lstm" and w_hr is None and step_bias is None:
                stacked, h, c = _fused_recurrence(projected, h0[index], c0[index], w_hh, reverse=direction == 1)
                outputs.append(stacked)
                h_n.append(h)
                c_n.append(c)
                continue
            if fused and op == "gru":
                stacked, h = _fused_gru(projected, h0[index], w_hh, step_bias, direction == 1)
                outputs.append(stacked)
                h_n.append(h)
                c_n.append(None)
                continue
            out, h, c = _run_direction(cell, list(projected.unbind(0)), h0[index], None if c0 is None else c0[index],
                                       w_hh, step_bias, w_hr, reverse=direction == 1)
            outputs.append(torch.stack(out))
            h_n.append(h)
            c_n.append(c)
        layer_input = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if dropout > 0 and train and layer < num_layers - 1:
            layer_input = torch.dropout(layer_input, dropout, train)
    output = layer_input.transpose(0, 1) if batch_first else layer_input
    if op == "lstm":
        return output, torch.stack(h_n), torch.stack(c_n)
    return output, torch.stack(h_n)


def _run_packed_direction(cell: Cell, projected: torch.Tensor, sizes: list[int], h0: torch.Tensor,
                          c0: torch.Tensor | None, w_hh: torch.Tensor, b_hh: torch.Tensor | None,
                          w_hr: torch.Tensor | None, reverse: bool,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One direction over packed data: step t runs the first ``sizes[t]`` sequences (sorted by decreasing length).

    Forward, a sequence's final state is the one it had when it stopped being active; in reverse, sequences join as
    the loop reaches their last step, starting from their initial state."""
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    outputs: list[torch.Tensor] = [None] * len(sizes)  # type: ignore[list-item]
    if not reverse:
        h, c = h0, c0
        finished_h: list[torch.Tensor] = []
        finished_c: list[torch.Tensor] = []
        for t, size in enumerate(sizes):
            if size < h.shape[0]:  # sequences size.. ended at t - 1
                finished_h.append(h[size:])
                h = h[:size]
                if c is not None:
                    finished_c.append(c[size:])
                    c = c[:size]
            h, c = cell(projected[offsets[t]:offsets[t + 1]], h, c, w_hh, b_hh, w_hr)
            outputs[t] = h
        h_n = torch.cat([h, *reversed(finished_h)])
        c_n = None if c is None else torch.cat([c, *reversed(finished_c)])
        return torch.cat(outputs), h_n, c_n
    h, c = h0[:sizes[-1]], None if c0 is None else c0[:sizes[-1]]
    for t in range(len(sizes) - 1, -1, -1):
        size = sizes[t]
        if size > h.shape[0]:  # sequences h.shape[0]..size have their last step at t
            h = torch.cat([h, h0[h.shape[0]:size]])
            if c is not None:
                c = torch.cat([c, c0[c.shape[0]:size]])
        h, c = cell(projected[offsets[t]:offsets[t + 1]], h, c, w_hh, b_hh, w_hr)
        outputs[t] = h
    return torch.cat(outputs), h, c


def _unrolled_packed(op: str, data: torch.Tensor, batch_sizes: torch.Tensor, hx, params, has_biases: bool,
                     num_layers: int, dropout: float, train: bool, bidirectional: bool):
    if data.dim() != 2:
        raise ValueError(f"{op}: packed data must be 2-D (total steps, features), got shape {tuple(data.shape)}")
    if torch._C._functorch.is_batchedtensor(batch_sizes):
        raise ValueError(f"{op}: batch_sizes of a packed sequence must be the same for every sample under vmap; "
                         "pack outside vmap (pack_padded_sequence under vmap batches them) and vmap over the "
                         "packed data")
    sizes = [int(size) for size in batch_sizes.tolist()]
    if sum(sizes) != data.shape[0] or any(a < b for a, b in pairwise(sizes)):
        raise ValueError(f"{op}: batch_sizes {sizes} must be non-increasing and sum to data's {data.shape[0]} rows")
    cell = _CELLS[op]
    h0, c0 = _initial_states(op, hx)
    directions = 2 if bidirectional else 1
    layers = _layer_params(op, params, has_biases, num_layers, bidirectional)
    layer_input = data
    h_n, c_n = [], []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            w_ih, w_hh, b_ih, b_hh, w_hr = layers[index]
            projected, step_bias = _project(op, layer_input, w_ih, b_ih, b_hh)
            out, h, c = _run_packed_direction(cell, projected, sizes, h0[index], None if c0 is None else c0[index],
                                              w_hh, step_bias, w_hr, reverse=direction == 1)
            outputs.append(out)
            h_n.append(h)
            c_n.append(c)
        layer_input = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if dropout > 0 and train and layer < num_layers - 1:
            layer_input = torch.dropout(layer_input, dropout, train)
    if op == "lstm":
        return layer_input, torch.stack(h_n), torch.stack(c_n)
    return layer_input, torch.stack(h_n)


# --- the LSTM recurrence as one primitive: per-sample hidden-weight gradients in one product -----------------------
#
# Unrolled under vmap(grad), every step's ``h @ w_hh^T`` gives the hidden weight a gradient of its own, a per-sample
# outer product (B, 4H, H) that autograd then adds to the others, step after step: two passes over B x 4H x H per
# step. The primitive runs the recurrence below every transform on the physical batch, and its backward (BPTT, on
# plain tensors) forms the hidden-weight gradient of each sample once, as one product over the time steps.


def _lstm_steps(projected: torch.Tensor, h: torch.Tensor, c: torch.Tensor, w_hh: torch.Tensor, reverse: bool,
                keep: bool):
    """The recurrence on plain tensors: ``projected`` (*lead, T, N, 4H), ``h``, ``c`` (*lead, N, H), ``w_hh``
    (4H, H) or (*lead', 4H, H), broadcasting against the leading dimensions. Returns the outputs (*lead, T, N, H), the
    last states and, with ``keep``, each step's (previous h, previous c, gates after their activations)."""
    hidden = h.shape[-1]
    steps = projected.shape[-3]
    order = range(steps - 1, -1, -1) if reverse else range(steps)
    w_t = w_hh.transpose(-1, -2)
    outputs: list[torch.Tensor] = [None] * steps  # type: ignore[list-item]
    kept = []
    for t in order:
        gates = torch.matmul(h, w_t).add_(projected[..., t, :, :])
        activated = torch.sigmoid(gates)
        g = torch.tanh(gates[..., 2 * hidden:3 * hidden])
        i, f, o = activated[..., :hidden], activated[..., hidden:2 * hidden], activated[..., 3 * hidden:]
        if keep:
            kept.append((h, c, i, f, g, o))
        c = f * c + i * g
        h = o * torch.tanh(c)
        outputs[t] = h
    return torch.stack(outputs, -3), h, c, kept


_CPP_STEPS_DTYPES = (torch.float32, torch.float64)
# A module's parameter is an ordinary tensor to the kernels (no __torch_function__ of its own, no other storage).
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _cpp_steps(projected: torch.Tensor, states: Sequence[torch.Tensor], w_hh: torch.Tensor,
               bias: torch.Tensor | None = None, others: Sequence[torch.Tensor] = ()) -> Any:
    """``torch.ops.multicomposite`` where a recurrence's steps can run in C++ (``registry/core/kernels/
    recurrence.cpp``'s NOTE): the C++ build loaded, every tensor an ordinary CPU float or double tensor of one dtype
    (no functorch wrapper, no subclass), a 2-d hidden weight, a 1-d hidden bias or none, each state of the
    projection's leading shape; else None (the Python steps)."""
    from registry.core import kernels

    if w_hh.dim() != 2 or projected.dim() < 3 or (bias is not None and bias.dim() != 1):
        return None
    state_shape = projected.shape[:-3] + projected.shape[-2:-1] + states[0].shape[-1:]
    if any(state.shape != state_shape for state in states):
        return None
    tensors = (projected, *states, w_hh, *others, *(() if bias is None else (bias,)))
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors) or not _ordinary_cpu(tensors,
                                                                                                      projected.dtype):
        return None
    return torch.ops.multicomposite if kernels.fused_ops_available() else None


def _ordinary_cpu(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether every tensor is what the C++ steps take: an ordinary CPU tensor (or parameter) of ``dtype``, float or
    double."""
    return dtype in _CPP_STEPS_DTYPES and all(type(t) in _PLAIN_TYPES and t.dtype == dtype and t.device.type == "cpu"
                                              for t in tensors)


class LSTMRecurrence(Function):
    """An LSTM layer's recurrence over one direction from its input projection: (outputs, h_T, c_T) of
    ``(projected, h0, c0, w_hh)``, with its own backward (BPTT) and vmap rule (the whole batch at once)."""

    generate_vmap_rule = False

    @staticmethod
    def forward(projected, h0, c0, w_hh, reverse):
        ops = _cpp_steps(projected, (h0, c0), w_hh)
        if ops is not None:
            return ops.lstm_recurrence(projected, h0, c0, w_hh, reverse)
        out, h, c, _ = _lstm_steps(projected, h0, c0, w_hh, reverse, keep=False)
        return out, h, c

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        projected, h0, c0, w_hh, ctx.reverse = inputs
        ctx.save_for_backward(projected, h0, c0, w_hh)

    @staticmethod
    def backward(ctx: Any, d_out, d_h, d_c):
        projected, h0, c0, w_hh = ctx.saved_tensors
        out_shape = (*projected.shape[:-1], h0.shape[-1])
        d_out = projected.new_zeros(out_shape) if d_out is None else d_out
        d_h = torch.zeros_like(h0) if d_h is None else d_h
        d_c = torch.zeros_like(c0) if d_c is None else d_c
        grads = apply(LSTMRecurrenceBackward, projected, h0, c0, w_hh, d_out, d_h, d_c, ctx.reverse)
        return (*grads, None)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any):
        raise NotImplementedError("lstm's recurrence primitive has no forward AD; the selector picks the unrolled "
                                  "composite under jvp and jacfwd")

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], projected, h0, c0, w_hh, reverse):
        projected, h0, c0 = batch_first(info, in_dims[:3], projected, h0, c0)
        w_hh = _weight_batch_first(w_hh, in_dims[3], projected.dim() - 3)
        return apply(LSTMRecurrence, projected, h0, c0, w_hh, reverse), (0, 0, 0)


def _weight_batch_first(w_hh: torch.Tensor, dim: int | None, lead: int) -> torch.Tensor:
    """The hidden weight with its batch dimension first and singletons after it up to ``lead`` leading dimensions
    (right-aligned broadcasting against the states), or as it is where unbatched at this level: never expanded."""
    if dim is None:
        return w_hh
    w_hh = w_hh.movedim(dim, 0)
    while w_hh.dim() - 2 < lead:
        w_hh = w_hh.unsqueeze(1)
    return w_hh


class LSTMRecurrenceBackward(Function):
    """BPTT of ``LSTMRecurrence`` on plain tensors: recompute the steps, then walk them back. The gradients of the
    projection and the states have the inputs' shapes; the hidden weight's has the leading (per-sample) dimensions
    of the states, one product over the steps and rows."""

    generate_vmap_rule = False

    @staticmethod
    def forward(projected, h0, c0, w_hh, d_out, d_h, d_c, reverse):
        ops = _cpp_steps(projected, (h0, c0, d_h, d_c), w_hh, others=(d_out,))
        if ops is not None and d_out.shape == projected.shape[:-1] + h0.shape[-1:]:
            return ops.lstm_steps_backward(projected, h0, c0, w_hh, d_out, d_h, d_c, reverse)
        _, _, _, kept = _lstm_steps(projected, h0, c0, w_hh, reverse, keep=True)
        hidden = h0.shape[-1]
        steps = projected.shape[-3]
        order = range(steps) if reverse else range(steps - 1, -1, -1)  # the forward's steps, last first
        d_h = d_h.clone()
        d_c = d_c.clone()
        d_gates: list[torch.Tensor] = [None] * steps  # type: ignore[list-item]
        previous: list[torch.Tensor] = [None] * steps  # type: ignore[list-item]
        for position, t in enumerate(order):
            h_prev, c_prev, i, f, g, o = kept[len(kept) - 1 - position]
            d_h = d_h + d_out[..., t, :, :]
            c = f * c_prev + i * g
            tanh_c = torch.tanh(c)
            d_o = d_h * tanh_c
            d_c = d_c + d_h * o * (1 - tanh_c * tanh_c)
            d_i, d_f, d_g = d_c * g, d_c * c_prev, d_c * i
            d_c = d_c * f
            gate = torch.cat([d_i * i * (1 - i), d_f * f * (1 - f), d_g * (1 - g * g), d_o * o * (1 - o)], -1)
            d_gates[t], previous[t] = gate, h_prev
            d_h = torch.matmul(gate, w_hh)
        stacked = torch.stack(d_gates, -3)  # (*lead, T, N, 4H): the projection's gradient
        lead = stacked.shape[:-3]
        rows = stacked.reshape(*lead, -1, 4 * hidden)
        states = torch.stack(previous, -3).expand(*lead, steps, *h0.shape[-2:]).reshape(*lead, -1, hidden)
        d_w = torch.matmul(rows.transpose(-1, -2), states)  # each sample's (4H, H), summed over steps and rows
        return stacked, d_h, d_c, d_w

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any):
        raise NotImplementedError("lstm's recurrence primitive has no second derivative; the selector picks the "
                                  "unrolled composite for hessian and grad of grad")

    @staticmethod
    def jvp(ctx: Any, *tangents: Any):
        raise NotImplementedError("lstm's recurrence primitive has no forward AD")

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], projected, h0, c0, w_hh, d_out, d_h, d_c, reverse):
        tensors = batch_first(info, in_dims[:3] + in_dims[4:7], projected, h0, c0, d_out, d_h, d_c)
        w_hh = _weight_batch_first(w_hh, in_dims[3], tensors[0].dim() - 3)
        return apply(LSTMRecurrenceBackward, *tensors[:3], w_hh, *tensors[3:], reverse), (0, 0, 0, 0)


def _fused_recurrence(projected: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, w_hh: torch.Tensor, reverse: bool):
    """(outputs (T, N, H), h_T, c_T) of one direction: ``multicomposite::lstm_recurrence`` where ``_recurrence_ops``
    allows, else ``LSTMRecurrence``."""
    ops = _recurrence_ops(4, projected, (h0, c0), w_hh)
    if ops is not None:
        return ops.lstm_recurrence(projected, h0, c0, w_hh, reverse)
    return apply(LSTMRecurrence, projected, h0, c0, w_hh, reverse)


def _fused_gru(projected: torch.Tensor, h0: torch.Tensor, w_hh: torch.Tensor, b_hh: torch.Tensor | None,
               reverse: bool):
    """(outputs (T, N, H), h_T) of one direction: ``multicomposite::gru_recurrence`` where ``_recurrence_ops``
    allows, else ``GRURecurrence``."""
    ops = _recurrence_ops(3, projected, (h0,), w_hh, b_hh)
    if ops is not None:
        return ops.gru_recurrence(projected, h0, w_hh, b_hh, reverse)
    return apply(GRURecurrence, projected, h0, w_hh, b_hh, reverse)


_OP_TRANSFORMS = frozenset(("vmap", "grad"))


def _recurrence_ops(gates: int, projected: torch.Tensor, states: Sequence[torch.Tensor], w_hh: torch.Tensor,
                    b_hh: torch.Tensor | None = None) -> Any:
    """``torch.ops.multicomposite`` where a recurrence of ``gates`` gates can run as its C++ op (recurrence.cpp's
    NOTE [recurrence ops]), else None (the primitive): the C++ build loaded; no transform but vmap and grad levels (no
    forward AD, no functionalize, not traced); one (T, N, G * H) projection with (N, H) states, a (G * H, H) hidden
    weight and a (G * H) hidden bias or none, the weight and bias batched at no level; every tensor, under its
    functorch wrappers, an ordinary CPU float or double tensor (or parameter) of one dtype."""
    from registry.core import kernels

    if torch.compiler.is_compiling() or torch.autograd.forward_ad._current_level >= 0:
        return None
    if any(transform not in _OP_TRANSFORMS for transform, _ in functorch_stack()):
        return None
    if projected.dim() != 3 or w_hh.dim() != 2 or not projected.shape[-1] == w_hh.shape[0] == gates * w_hh.shape[1]:
        return None
    state_shape = (projected.shape[1], w_hh.shape[1])
    if any(state.shape != state_shape for state in states) or (b_hh is not None and b_hh.shape != w_hh.shape[:1]):
        return None
    weights = (w_hh,) if b_hh is None else (w_hh, b_hh)
    if any(vmap_levels(weight) for weight in weights):
        return None
    if not _ordinary_cpu([innermost(tensor) for tensor in (projected, *states, *weights)], projected.dtype):
        return None
    return torch.ops.multicomposite if kernels.fused_ops_available() else None


def _gru_steps(projected: torch.Tensor, h: torch.Tensor, w_hh: torch.Tensor, b_hh: torch.Tensor | None,
               reverse: bool, keep: bool):
    """The GRU recurrence on plain tensors, PyTorch's formulas (``_gru_cell``); shapes as in ``_lstm_steps``, the
    hidden bias (3H) or None added to every step's hidden product. With ``keep``, each step's (previous h, hidden
    product, reset, update, new)."""
    gates = 2 * h.shape[-1]
    steps = projected.shape[-3]
    order = range(steps - 1, -1, -1) if reverse else range(steps)
    w_t = w_hh.transpose(-1, -2)
    outputs: list[torch.Tensor] = [None] * steps  # type: ignore[list-item]
    kept = []
    for t in order:
        x_t = projected[..., t, :, :]
        h_w = torch.matmul(h, w_t)
        if b_hh is not None:
            h_w = h_w + b_hh.unsqueeze(-2)
        reset, update = torch.sigmoid(x_t[..., :gates] + h_w[..., :gates]).chunk(2, -1)
        new = torch.tanh(x_t[..., gates:] + reset * h_w[..., gates:])
        if keep:
            kept.append((h, h_w, reset, update, new))
        h = (h - new) * update + new
        outputs[t] = h
    return torch.stack(outputs, -3), h, kept


class GRURecurrence(Function):
    """A GRU layer's recurrence over one direction from its input projection: (outputs, h_T) of ``(projected, h0,
    w_hh, b_hh)``, with its own backward (BPTT) and vmap rule, as ``LSTMRecurrence``."""

    generate_vmap_rule = False

    @staticmethod
    def forward(projected, h0, w_hh, b_hh, reverse):
        ops = _cpp_steps(projected, (h0,), w_hh, bias=b_hh)
        if ops is not None:
            return ops.gru_recurrence(projected, h0, w_hh, b_hh, reverse)
        out, h, _ = _gru_steps(projected, h0, w_hh, b_hh, reverse, keep=False)
        return out, h

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        projected, h0, w_hh, b_hh, ctx.reverse = inputs
        ctx.has_bias = b_hh is not None
        ctx.save_for_backward(projected, h0, w_hh, *(() if b_hh is None else (b_hh,)))

    @staticmethod
    def backward(ctx: Any, d_out, d_h):
        projected, h0, w_hh, *bias = ctx.saved_tensors
        b_hh = bias[0] if bias else None
        d_out = projected.new_zeros((*projected.shape[:-1], h0.shape[-1])) if d_out is None else d_out
        d_h = torch.zeros_like(h0) if d_h is None else d_h
        d_projected, d_h0, d_w, d_b = apply(GRURecurrenceBackward, projected, h0, w_hh, b_hh, d_out, d_h,
                                            ctx.reverse)
        return d_projected, d_h0, d_w, d_b if ctx.has_bias else None, None

    @staticmethod
    def jvp(ctx: Any, *tangents: Any):
        raise NotImplementedError("gru's recurrence primitive has no forward AD; the selector picks the unrolled "
                                  "composite under jvp and jacfwd")

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], projected, h0, w_hh, b_hh, reverse):
        projected, h0 = batch_first(info, in_dims[:2], projected, h0)
        lead = projected.dim() - 3
        w_hh = _weight_batch_first(w_hh, in_dims[2], lead)
        b_hh = None if b_hh is None else _weight_batch_first(b_hh.unsqueeze(-1), in_dims[3], lead).squeeze(-1)
        return apply(GRURecurrence, projected, h0, w_hh, b_hh, reverse), (0, 0)


class GRURecurrenceBackward(Function):
    """BPTT of ``GRURecurrence`` on plain tensors: the gradients of the projection, h0, and each sample's hidden
    weight and bias (one product over the steps and rows)."""

    generate_vmap_rule = False

    @staticmethod
    def forward(projected, h0, w_hh, b_hh, d_out, d_h, reverse):
        ops = _cpp_steps(projected, (h0, d_h), w_hh, bias=b_hh, others=(d_out,))
        if ops is not None and d_out.shape == projected.shape[:-1] + h0.shape[-1:]:
            return ops.gru_steps_backward(projected, h0, w_hh, b_hh, d_out, d_h, reverse)
        _, _, kept = _gru_steps(projected, h0, w_hh, b_hh, reverse, keep=True)
        hidden = h0.shape[-1]
        steps = projected.shape[-3]
        order = range(steps) if reverse else range(steps - 1, -1, -1)
        d_inputs: list[torch.Tensor] = [None] * steps  # type: ignore[list-item]
        d_hidden: list[torch.Tensor] = [None] * steps  # type: ignore[list-item]
        previous: list[torch.Tensor] = [None] * steps  # type: ignore[list-item]
        d_h = d_h.clone()
        for position, t in enumerate(order):
            h_prev, h_w, reset, update, new = kept[len(kept) - 1 - position]
            d_h = d_h + d_out[..., t, :, :]
            d_new = d_h * (1 - update) * (1 - new * new)
            d_update = d_h * (h_prev - new) * update * (1 - update)
            d_reset = d_new * h_w[..., 2 * hidden:] * reset * (1 - reset)
            d_hw = torch.cat([d_reset, d_update, d_new * reset], -1)
            d_inputs[t] = torch.cat([d_reset, d_update, d_new], -1)
            d_hidden[t], previous[t] = d_hw, h_prev
            d_h = d_h * update + torch.matmul(d_hw, w_hh)
        d_projected = torch.stack(d_inputs, -3)
        lead = d_projected.shape[:-3]
        rows = torch.stack(d_hidden, -3).reshape(*lead, -1, 3 * hidden)
        states = torch.stack(previous, -3).expand(*lead, steps, *h0.shape[-2:]).reshape(*lead, -1, hidden)
        d_w = torch.matmul(rows.transpose(-1, -2), states)
        d_b = rows.sum(-2)
        return d_projected, d_h, d_w, d_b

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any):
        raise NotImplementedError("gru's recurrence primitive has no second derivative; the selector picks the "
                                  "unrolled composite for hessian and grad of grad")

    @staticmethod
    def jvp(ctx: Any, *tangents: Any):
        raise NotImplementedError("gru's recurrence primitive has no forward AD")

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], projected, h0, w_hh, b_hh, d_out, d_h, reverse):
        projected, h0, d_out, d_h = batch_first(info, in_dims[:2] + in_dims[4:6], projected, h0, d_out, d_h)
        lead = projected.dim() - 3
        w_hh = _weight_batch_first(w_hh, in_dims[2], lead)
        b_hh = None if b_hh is None else _weight_batch_first(b_hh.unsqueeze(-1), in_dims[3], lead).squeeze(-1)
        return apply(GRURecurrenceBackward, projected, h0, w_hh, b_hh, d_out, d_h, reverse), (0, 0, 0, 0)


# --- the composites -------------------------------------------------------------------------------------------------


@register("rnn_tanh", "functional", name="unrolled")
def rnn_tanh_unrolled(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """Batched tanh cells over time: one input product per layer, a loop of hidden products and gates."""
    return _unrolled("rnn_tanh", input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                     batch_first)


@register("rnn_relu", "functional", name="unrolled")
def rnn_relu_unrolled(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """Batched relu cells over time: one input product per layer, a loop of hidden products and gates."""
    return _unrolled("rnn_relu", input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                     batch_first)


@register("gru", "functional", name="unrolled")
def gru_unrolled(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """Batched GRU cells over time: one input product per layer, a loop of hidden products and gates."""
    return _unrolled("gru", input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)


@register("lstm", "functional", name="unrolled")
def lstm_unrolled(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """Batched LSTM cells over time (with the projection when proj_size > 0): one input product per layer, a loop
    of hidden products and gates."""
    return _unrolled("lstm", input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)


@register("lstm", "primitive", name="recurrence", function=LSTMRecurrence)
def lstm_recurrence(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """The unrolled LSTM with each layer's recurrence as one primitive (without a projection, proj_size 0): its
    backward forms each sample's hidden-weight gradient as one product over the time steps."""
    return _unrolled("lstm", input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first,
                     fused=True)


@register("gru", "primitive", name="recurrence", function=GRURecurrence)
def gru_recurrence(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """The unrolled GRU with each layer's recurrence as one primitive: its backward forms each sample's
    hidden-weight and hidden-bias gradients as one product and one sum over the time steps."""
    return _unrolled("gru", input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first,
                     fused=True)


@register_derivative("rnn_tanh", "rnn_tanh.data")
def rnn_tanh_unrolled_packed(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional):
    """rnn_tanh over a packed sequence: each step on the sequences still active."""
    return _unrolled_packed("rnn_tanh", data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
                            bidirectional)


@register_derivative("rnn_relu", "rnn_relu.data")
def rnn_relu_unrolled_packed(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional):
    """rnn_relu over a packed sequence: each step on the sequences still active."""
    return _unrolled_packed("rnn_relu", data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
                            bidirectional)


@register_derivative("gru", "gru.data")
def gru_unrolled_packed(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional):
    """gru over a packed sequence: each step on the sequences still active."""
    return _unrolled_packed("gru", data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
                            bidirectional)


@register_derivative("lstm", "lstm.data")
def lstm_unrolled_packed(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional):
    """lstm over a packed sequence: each step on the sequences still active."""
    return _unrolled_packed("lstm", data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
                            bidirectional)
