"""Profiling: timing composites side by side with native."""
