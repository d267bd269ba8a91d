"""How two timings compare: the least relative difference that counts as one, and a ratio said in words.

The selector ranks profiled composites with these, and the profiler judges its own rounds with them
(registry/profiling/noise.py says how timings are taken so that noise cannot flip a decision).
"""

from __future__ import annotations

# The least relative difference that counts as a difference when two timings are compared (the floor of "noise").
MIN_NOISE = 0.05


def ratio_text(ratio: float, other: str) -> str:
    """``time / other's time`` in words that never say "0.62x faster": "1.61x slower than X" or "1.61x faster
    than X" (a ratio under 1 is faster)."""
    if ratio <= 1:
        return f"{1 / ratio:.2f}x faster than {other}"
    return f"{ratio:.2f}x slower than {other}"
