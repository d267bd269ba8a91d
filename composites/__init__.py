"""Built-in composites, one module per operator family. Importing this package registers them all."""

from composites import (
    attention,
    copies,
    elementwise,
    index,
    indexing,
    linalg,
    losses,
    masked,
    memory,
    normalization,
    pooling,
    reduce,
    resample,
    statistics,
)

__all__ = [
    "attention",
    "copies",
    "elementwise",
    "index",
    "indexing",
    "linalg",
    "losses",
    "masked",
    "memory",
    "normalization",
    "pooling",
    "reduce",
    "resample",
    "statistics",
]
