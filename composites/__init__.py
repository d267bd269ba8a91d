"""Built-in composites, one module per operator family. Importing this package registers them all."""

from composites import copies, index, indexing, linalg, masked, memory

__all__ = ["copies", "index", "indexing", "linalg", "masked", "memory"]
