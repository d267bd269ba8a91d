"""Function objects captured at import, before any ``use()``: what libraries and test suites keep in tables."""

import functools

import torch
from torch import index_fill, masked_scatter

stored_masked_fill = torch.Tensor.masked_fill
fill_rows = functools.partial(torch.index_fill, dim=0)
CAPTURED = {"masked_scatter": masked_scatter, "index_fill": index_fill, "masked_fill": stored_masked_fill}
