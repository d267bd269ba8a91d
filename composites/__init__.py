"""Built-in composites, one module per operator family. Importing this package registers them all."""

from composites import elementwise, index, indexing, masked, memory, resample, statistics

__all__ = ["elementwise", "index", "indexing", "masked", "memory", "resample", "statistics"]
