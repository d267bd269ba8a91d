"""Built-in composites, one module per operator family. Importing this package registers them all."""

from composites import (
    attention,
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
    "attention",
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
