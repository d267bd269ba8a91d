"""Benchmarks: ``python -m bench``. Ratios are measured side by side in one process with torch.utils.benchmark."""
