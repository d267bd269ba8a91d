"""Built-in composites, one module per operator family. Importing this package registers them all."""

from composites import index, masked, memory

__all__ = ["index", "masked", "memory"]
