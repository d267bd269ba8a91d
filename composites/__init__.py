"""Built-in composites, one module per operator family. Importing this package registers them all."""

from composites import index, indexing, losses, masked, memory, normalization

__all__ = ["index", "indexing", "losses", "masked", "memory", "normalization"]
