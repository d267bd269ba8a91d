"""Built-in composites, one module per operator family. Importing this package registers them all."""

from composites import copies, index, indexing, masked, memory

__all__ = ["copies", "index", "indexing", "masked", "memory"]
