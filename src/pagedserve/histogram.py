"""Prometheus' histogram_quantile estimate, for the live page (server) and the benchmarks (bench),
which both read latency quantiles from the server's histograms."""

from __future__ import annotations

import math
from collections.abc import Sequence


def histogram_quantile(bounds: Sequence[float], counts: Sequence[float], q: float) -> float | None:
    """The q-quantile of a histogram of cumulative counts per ascending upper bound (the last
    +inf), linear within the bucket holding the rank; None for an empty histogram."""
    total = counts[-1] if counts else 0.0
    if total == 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, cumulative in zip(bounds, counts, strict=True):
        if cumulative >= rank:
            if math.isinf(bound):
                return lower  # beyond the last finite bucket: its bound is all we know
            inside = cumulative - below
            return lower + (bound - lower) * (rank - below) / inside if inside else bound
        lower, below = bound, cumulative
    return lower
