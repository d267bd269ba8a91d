"""Built-in composites, one module per operator family. Importing this package registers them all."""

from composites import index, indexing, masked, memory, pooling, reduce

__all__ = ["index", "indexing", "masked", "memory", "pooling", "reduce"]
