"""``contiguous`` and ``to`` under vmap: with their default memory format PyTorch's own op runs (it batches, and a
composite would only add a Python frame); with another memory format, which vmap cannot run natively, a composite
does; both equal the per-sample loop."""

from __future__ import annotations

import pytest
import torch
from torch import func

import registry
from registry.core import selector
from registry.core.context import Context


@pytest.mark.parametrize("op", ["contiguous", "to"])
def test_the_default_memory_format_is_native_under_vmap_and_another_is_not(op: str) -> None:
    default = selector.decide(op, Context(stack=("vmap",), batched=("self",), dtype=torch.float32, device="cpu"))
    assert default.composite == "native"
    given = selector.decide(op, Context(stack=("vmap",), batched=("self",), dtype=torch.float32, device="cpu",
                                        given=("memory_format",)))
    assert given.kind != "native"
    assert "memory_format other than contiguous_format fails under vmap" in dict(
        (v.composite, v.reason) for v in given.alternatives)["native"]


def test_under_vmap_inside_use_both_equal_the_loop() -> None:
    x = torch.randn(3, 2, 4, 5, 6).transpose(-1, -2)
    cases = {
        "contiguous": lambda t: t.contiguous(),
        "contiguous channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
        "to float64": lambda t: t.to(torch.float64),
        "to channels_last": lambda t: t.to(memory_format=torch.channels_last),
    }
    for name, fn in cases.items():
        with registry.use():
            got = func.vmap(fn)(x)
        want = torch.stack([fn(sample) for sample in x])
        torch.testing.assert_close(got, want, msg=name)
        assert got.dtype == want.dtype, name
