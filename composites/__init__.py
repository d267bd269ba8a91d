"""Built-in composites, one module per operator family. Importing this package registers them all."""

from composites import (
    copies,
    elementwise,
    embedding,
    index,
    indexing,
    linalg,
    losses,
    masked,
    memory,
    normalization,
    pooling,
    recurrent,
    reduce,
    resample,
    statistics,
)

__all__ = [
    "copies",
    "elementwise",
    "embedding",
    "index",
    "indexing",
    "linalg",
    "losses",
    "masked",
    "memory",
    "normalization",
    "pooling",
    "recurrent",
    "reduce",
    "resample",
    "statistics",
]
