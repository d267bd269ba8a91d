"""Composites of the flat-index family: ``take``."""

from __future__ import annotations

import torch

from registry.core import rules
from registry.core.registration import define_op, register

aten = torch.ops.aten

define_op(
    "take", "", tensors=("self", "index"), doc="self's elements at the flat indices index", opinfo=("take",),
    inplace=False,
    rules={"native": rules.first_of(rules.no_batching_rule("aten::take"),
                                    rules.backward_without_batching_rule("aten::put_"))},
)


@register("take", "functional")
def take_functional(self, index):
    """self flattened, indexed by index: advanced indexing batches, and its backward is index_put."""
    return self.reshape(-1)[index]


define_op(
    "put", "", tensors=("self", "index", "source"), doc="self with source written (or added) at the flat indices index",
    opinfo=("put",), inplace=False,
    # put has no batching rule, and its backward calls put and take (source's gradient), which have none either.
    rules={"native": rules.first_of(rules.no_batching_rule("aten::put"),
                                    rules.backward_without_batching_rule("aten::take"))},
)


@register("put", "functional")
def put_functional(self, index, source, accumulate=False):
    """self flattened, index_put at the flat indices: index_put batches, and its backward is indexing."""
    flat = self.reshape(-1).index_put((index.reshape(-1),), source.reshape(-1), accumulate)
    return flat.reshape(self.shape)
