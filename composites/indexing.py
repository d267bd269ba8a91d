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
