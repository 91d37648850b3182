"""Statistics shared by the sampling tests."""

from __future__ import annotations

import math


def chi2_sf(stat: float, df: int) -> float:
    """P(X ≥ stat) for X ~ chi-square(df), by the Wilson–Hilferty cube-root normal
    approximation (ample for thresholds of 1e-3 and 1e-6 at these sizes)."""
    mean = 1 - 2 / (9 * df)
    z = ((stat / df) ** (1 / 3) - mean) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))
