"""bench/programs.py's whole torch.func programs: inside use() each equals PyTorch's own result, or, where PyTorch
fails, the per-sample loop; nothing that runs natively fails inside use()."""

from __future__ import annotations

import warnings

import pytest
import torch

import registry
from bench import programs


@pytest.mark.parametrize("name", list(programs.PROGRAMS))
def test_inside_use_the_program_equals_native_or_the_loop(name: str) -> None:
    try:
        built = programs.build(name)
    except ModuleNotFoundError as missing:  # a program over an optional library (the models extra)
        pytest.skip(f"{name} needs {missing.name}: pip install 'multicomposite[models]'")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's performance warnings, natively
        try:
            expected = built.run()
        except RuntimeError:
            assert built.loop is not None, f"{name} fails natively and has no per-sample loop to compare with"
            expected = built.loop()
        else:
            assert built.loop is None, f"{name} runs natively: its loop is not needed"
        with registry.use():
            got = built.run()
    got_leaves, expected_leaves = programs.leaves(got), programs.leaves(expected)
    assert len(got_leaves) == len(expected_leaves) > 0
    for a, b in zip(got_leaves, expected_leaves, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
